import { groupRanks, labelledText, rankLabel } from '../src/rankoutput';

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
