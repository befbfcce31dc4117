import {
  formatAge,
  formatBytes,
  formatStep,
  insertCellCode,
  IRankRow,
  IStatusReply,
  parseReply,
  rankCells,
  rankLevel,
  rankTitle,
  statusBarText
} from '../src/format';

const row = (over: Partial<IRankRow> = {}): IRankRow => ({
  rank: 0,
  state: 'idle',
  step: null,
  memory: { rss: 300 * 2 ** 20, cuda: null },
  heartbeat_age: 0.42,
  cell: '',
  problem: '',
  ...over
});

const status = (over: Partial<IStatusReply> = {}): IStatusReply => ({
  reply: 'status',
  pool: '2 CPU ranks · ddp',
  state: 'idle',
  ranks: [row(), row({ rank: 1 })],
  ...over
});

describe('status bar', () => {
  it('names the pool and its state', () => {
    expect(statusBarText(status(), false)).toBe('2 CPU ranks · ddp · idle');
    expect(statusBarText(status({ state: 'running' }), true)).toBe(
      '2 CPU ranks · ddp · running (kernel busy)'
    );
  });

  it('is empty without a pool', () => {
    expect(statusBarText(null, false)).toBe('');
    expect(statusBarText(status({ pool: null, state: 'no pool', ranks: [] }), false)).toBe('');
  });
});

describe('rank rows', () => {
  it('formats memory, step and heartbeat', () => {
    expect(rankCells(row({ step: 12 }))).toEqual(['0', 'idle', '12', '300 MiB']);
    const gpu = row({ memory: { rss: 2 ** 30, cuda: 3.5 * 2 ** 30 }, cell: 'loss = ...' });
    expect(rankCells(gpu)[3]).toBe('3.5 GiB'); // on GPU the column is CUDA memory
    expect(rankTitle(gpu)).toBe('rank 0: idle\nheartbeat 0.4 s ago\nhost 1.0 GiB · cuda 3.5 GiB\ncell: loss = ...');
  });

  it('shows the problem rather than the cell and marks the row', () => {
    const stuck = row({ state: 'running', cell: 'x', problem: 'stuck: no heartbeat for 7 s' });
    expect(rankCells(stuck)[1]).toBe('stuck');
    expect(rankTitle(stuck).split('\n')[0]).toBe('rank 0: stuck: no heartbeat for 7 s');
    expect(rankLevel(stuck)).toBe('warn');
    expect(rankLevel(row({ state: 'dead', problem: 'dead: exit 1' }))).toBe('error');
    const broken = row({
      state: 'broken',
      problem: 'broken: CUDA context lost (CUDA error: device-side assert triggered); %dist_restart for fresh ranks'
    });
    expect(rankLevel(broken)).toBe('error');
    expect(rankCells(broken)[1]).toBe('broken');
    expect(rankTitle(broken)).toContain('CUDA context lost');
    expect(rankLevel(row())).toBe('ok');
    expect(rankLevel(row({ state: 'at a prompt', cell: 'breakpoint() · at (Pdb)' }))).toBe('warn');
  });

  it('names a row of many ranks by their range and count (from 9 ranks)', () => {
    const idle = row({ rank: '0-4,6-1023', count: 1023, step: 7, memory: { rss: 2 ** 30, cuda: null } });
    expect(rankCells(idle)).toEqual(['0-4,6-1023', 'idle (1023)', '7', '1.0 GiB']);
    expect(rankTitle(idle)).toBe(
      'ranks 0-4,6-1023 (1023): idle\nheartbeat at most 0.4 s ago\nlowest step 7\nhost at most 1.0 GiB'
    );
    const dead = row({ rank: '0-19', count: 20, state: 'dead', problem: 'dead: exit 1 (and 19 more)' });
    expect(rankCells(dead)[1]).toBe('dead (20)');
    expect(rankLevel(dead)).toBe('error');
    expect(rankCells(row({ rank: '5', count: 1 }))).toEqual(['5', 'idle', '–', '300 MiB']);
  });

  it('formats numbers for people', () => {
    expect(formatBytes(null)).toBe('–');
    expect(formatBytes(512)).toBe('512 B');
    expect(formatBytes(1536)).toBe('1.5 KiB');
    expect(formatAge(null)).toBe('–');
    expect(formatAge(12.6)).toBe('13 s');
    expect(formatStep(2.25)).toBe('2.3');
  });
});

describe('messages', () => {
  it('accepts only kernel replies', () => {
    expect(parseReply(status())).toEqual(status());
    expect(parseReply({ reply: 'stacks', text: 't' })).toEqual({ reply: 'stacks', text: 't' });
    expect(parseReply({ reply: 'other' })).toBeNull();
    expect(parseReply('status')).toBeNull();
    expect(parseReply(null)).toBeNull();
  });

  it("finds the picker's insert-cell message among widget messages", () => {
    const line = '%%distributed --nproc 2 --strategy ddp';
    expect(insertCellCode({ method: 'custom', content: { event: 'insert-cell', code: line } })).toBe(line);
    expect(insertCellCode({ method: 'update', state: {} })).toBeNull();
    expect(insertCellCode({ method: 'custom', content: { event: 'other', code: line } })).toBeNull();
    expect(insertCellCode({ method: 'custom', content: { event: 'insert-cell' } })).toBeNull();
    expect(insertCellCode(undefined)).toBeNull();
  });
});
