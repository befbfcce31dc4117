import {
  ALL_TAB,
  DIFF_LIMIT,
  diffLines,
  diffText,
  firstView,
  formatRanks,
  groupRanks,
  IRankOutput,
  labelledText,
  linesByRank,
  omittedNote,
  rankLabel,
  SUMMARY_TAB,
  summaryText
} from '../src/rankoutput';

describe('rank labels', () => {
  it('compresses runs of ranks', () => {
    expect(rankLabel([2])).toBe('rank 2');
    expect(rankLabel([3, 1, 0, 2])).toBe('ranks 0–3');
    expect(rankLabel([0, 1, 3, 5, 6])).toBe('ranks 0–1, 3, 5–6');
  });
});

describe('grouping', () => {
  it('collapses ranks with identical output', () => {
    const groups = groupRanks({
      version: 1,
      lines: [
        [0, 'stdout', 'epoch 1'],
        [1, 'stdout', 'epoch 1'],
        [2, 'stdout', 'epoch 1'],
        [3, 'stdout', 'epoch 1'],
        [0, 'stdout', 'saved'],
        [1, 'stdout', 'epoch 2'],
        [2, 'stdout', 'epoch 2'],
        [3, 'stdout', 'epoch 2']
      ]
    });
    expect(groups.map(g => g.label)).toEqual(['rank 0', 'ranks 1–3']);
    expect(groups[1].lines).toEqual([
      ['stdout', 'epoch 1'],
      ['stdout', 'epoch 2']
    ]);
  });

  it('keeps failed ranks apart and marks them, even without output', () => {
    const groups = groupRanks({
      version: 1,
      lines: [
        [0, 'stdout', 'x'],
        [1, 'stdout', 'x']
      ],
      failed: [1, 2]
    });
    expect(groups.map(g => [g.label, g.failed])).toEqual([
      ['rank 0', false],
      ['rank 1 (failed)', true],
      ['rank 2 (failed)', true]
    ]);
  });

  it('a stream name counts: the same text on stderr is different output', () => {
    const groups = groupRanks({
      version: 1,
      lines: [
        [0, 'stdout', 'x'],
        [1, 'stderr', 'x']
      ]
    });
    expect(groups).toHaveLength(2);
  });

  it('labels every line for the all-ranks view', () => {
    const output = { version: 1, lines: [[1, 'stdout', 'b'], [0, 'stderr', 'a']] as [number, string, string][] };
    expect(labelledText(output)).toBe('[rank 1] b\n[rank 0] a\n');
  });
});

describe('diff between two ranks', () => {
  const out = (...texts: string[]) => texts.map(t => ['stdout', t] as [string, string]);

  it('marks the lines only one rank printed', () => {
    const diff = diffLines(out('start', 'loss 0.5', 'saved', 'end'), out('start', 'loss 0.7', 'end', 'extra'));
    expect(diffText(diff)).toBe('  start\n- loss 0.5\n- saved\n+ loss 0.7\n  end\n+ extra\n');
  });

  it('identical output is all common lines, and an empty rank is all added or removed', () => {
    expect(diffLines(out('a', 'b'), out('a', 'b')).map(d => d.kind)).toEqual(['same', 'same']);
    expect(diffText(diffLines([], out('a')))).toBe('+ a\n');
    expect(diffText(diffLines(out('a'), []))).toBe('- a\n');
  });

  it('the same text on another stream differs, and keeps its stream', () => {
    const diff = diffLines([['stdout', 'x']], [['stderr', 'x']]);
    expect(diff).toEqual([
      { kind: 'del', name: 'stdout', text: 'x' },
      { kind: 'add', name: 'stderr', text: 'x' }
    ]);
  });

  it('keeps every line of both ranks in order, and is a longest common subsequence', () => {
    const a = out('1', '2', '3', '4', '5', '6');
    const b = out('2', '9', '4', '6', '7');
    const diff = diffLines(a, b);
    expect(diff.filter(d => d.kind !== 'add').map(d => d.text)).toEqual(['1', '2', '3', '4', '5', '6']);
    expect(diff.filter(d => d.kind !== 'del').map(d => d.text)).toEqual(['2', '9', '4', '6', '7']);
    expect(diff.filter(d => d.kind === 'same').map(d => d.text)).toEqual(['2', '4', '6']);
  });

  it('long outputs with a differing middle past the limit still keep head, tail and every line', () => {
    const middle = Math.ceil(Math.sqrt(DIFF_LIMIT)) + 1;
    const a = out('head', ...Array.from({ length: middle }, (_, i) => `a${i}`), 'tail');
    const b = out('head', ...Array.from({ length: middle }, (_, i) => `b${i}`), 'tail');
    const diff = diffLines(a, b);
    expect(diff[0]).toEqual({ kind: 'same', name: 'stdout', text: 'head' });
    expect(diff[diff.length - 1]).toEqual({ kind: 'same', name: 'stdout', text: 'tail' });
    expect(diff.filter(d => d.kind === 'del')).toHaveLength(middle);
    expect(diff.filter(d => d.kind === 'add')).toHaveLength(middle);
  });

  it('reads each rank’s lines from the bundle, failed ranks without output included', () => {
    const byRank = linesByRank({
      version: 1,
      lines: [
        [1, 'stdout', 'b'],
        [0, 'stderr', 'a']
      ],
      failed: [3]
    });
    expect([...byRank.entries()]).toEqual([
      [1, [['stdout', 'b']]],
      [0, [['stderr', 'a']]],
      [3, []]
    ]);
  });
});

describe('the summary view', () => {
  const output: IRankOutput = {
    version: 1,
    lines: [],
    summary: [
      [[0, 1, 2, 3, 5], 'stdout', 'step 1 loss 0.3 (rank 0; loss 0.29–0.31)'],
      [[], 'stdout', '… 12 more lines not shown here'],
      [[4], 'stderr', 'slow disk']
    ],
    view: 'summary'
  };

  it('writes ranks as the kernel does', () => {
    expect(formatRanks([5, 0, 1, 2, 3])).toBe('0-3,5');
    expect(formatRanks([7])).toBe('7');
  });

  it('labels each line with its ranks, notes without', () => {
    expect(summaryText(output)).toBe(
      '[rank 0-3,5] step 1 loss 0.3 (rank 0; loss 0.29–0.31)\n… 12 more lines not shown here\n[rank 4] slow disk\n'
    );
  });

  it('opens on the view the reader last chose, else the kernel\'s', () => {
    expect(firstView(output, null)).toBe(SUMMARY_TAB);
    expect(firstView({ ...output, view: 'all' }, null)).toBe(ALL_TAB);
    expect(firstView(output, ALL_TAB)).toBe(ALL_TAB);
    expect(firstView({ ...output, view: 'all' }, SUMMARY_TAB)).toBe(SUMMARY_TAB);
    expect(firstView(output, 'ranks 0–3')).toBe(SUMMARY_TAB); // not a choice that is remembered
    expect(firstView({ version: 1, lines: [] }, SUMMARY_TAB)).toBe(ALL_TAB); // an older kernel's bundle
  });
});

describe('a bundle that left lines out (1,024 ranks)', () => {
  const output: IRankOutput = {
    version: 2,
    lines: [
      [0, 'stdout', 'step 0'],
      [1, 'stdout', 'step 0'],
      [1022, 'stdout', 'step 29'],
      [1023, 'stdout', 'step 29']
    ],
    summary: [['0-1023', 'stdout', 'step 0 (1024 ranks)']],
    omitted: [2, 30716]
  };

  it('says in the every-line view where and how many lines were left out', () => {
    expect(labelledText(output).split('\n')).toEqual([
      '[rank 0] step 0',
      '[rank 1] step 0',
      omittedNote(30716),
      '[rank 1022] step 29',
      '[rank 1023] step 29',
      ''
    ]);
    expect(omittedNote(30716)).toContain('30,716 lines left out');
  });

  it('writes the summary from ranks the kernel already wrote, and from a list in older bundles', () => {
    expect(summaryText(output)).toBe('[rank 0-1023] step 0 (1024 ranks)\n');
    expect(summaryText({ version: 1, lines: [], summary: [[[0, 1, 2, 5], 'stdout', 'x'], [[], 'stdout', 'note']] })).toBe(
      '[rank 0-2,5] x\nnote\n'
    );
  });
});
