"""jupyter_shard.pool.summary: a cell's rank lines summarised, one line per line several ranks printed."""

from __future__ import annotations

import random

from jupyter_shard.pool import summary as summary_mod
from jupyter_shard.pool.summary import OutputSummary, split_numbers


def test_numbers_standing_alone_are_split_out_and_words_with_digits_are_not() -> None:
    assert split_numbers("step 5 loss 0.31 lr 1e-4 grad -2.5E+3") == (
        "step \0 loss \0 lr \0 grad \0",
        ["5", "0.31", "1e-4", "-2.5E+3"],
    )
    assert split_numbers("cuda0 v2 shard-05.bin x=3, y:4") == ("cuda0 v2 shard-05.bin x=\0, y:\0", ["3", "4"])
    assert split_numbers("loss nan grad inf") == ("loss \0 grad \0", ["nan", "inf"])


def test_a_64_rank_printing_loop_reads_as_one_line_per_step() -> None:
    rng = random.Random(3)
    summary = OutputSummary()
    for step in range(30):
        order = list(range(64))
        rng.shuffle(order)  # ranks' lines arrive interleaved
        for rank in order:
            summary.add(rank, "stdout", [f"step {step} loss {rng.uniform(0.2, 0.4):.4f}"])
    for rank in range(64):
        summary.add(rank, "stdout", ["epoch 1 done"])
    lines = summary.lines()
    assert len(lines) == 31  # against 1,984 interleaved lines
    assert lines[-1] == "[rank 0-63] epoch 1 done"
    for step, line in enumerate(lines[:30]):
        assert line.startswith(f"[rank 0-63] step {step} loss 0.")
        assert " (rank 0; loss 0." in line and line.endswith(")")
    assert summary.lines_in == 64 * 31


def test_the_range_is_the_lowest_and_highest_value_and_nans_are_counted() -> None:
    summary = OutputSummary()
    summary.add(2, "stdout", ["loss 0.5"])
    summary.add(0, "stdout", ["loss 0.25"])
    summary.add(1, "stdout", ["loss nan"])
    summary.add(3, "stdout", ["loss 10"])
    assert summary.lines() == ["[rank 0-3] loss 0.25 (rank 0; loss 0.25–10, nan on 1)"]


def test_lines_that_differ_in_words_or_streams_are_apart() -> None:
    summary = OutputSummary()
    summary.add(0, "stdout", ["loading shard a", "ready"])
    summary.add(1, "stdout", ["loading shard b", "ready"])
    summary.add(1, "stderr", ["ready"])
    assert summary.lines() == [
        "[rank 0] loading shard a",
        "[rank 0-1] ready",
        "[rank 1] loading shard b",
        "[rank 1] ready",
    ]


def test_every_line_a_rank_printed_is_in_exactly_one_entry_with_its_rank() -> None:
    """Random prints from random ranks: the entries' ranks add up to the lines in, each rank's
    lines of one template in its own order, and an entry of identical lines shows exactly that line."""
    rng = random.Random(5)
    words = ["step", "loss", "epoch done", "saving", "lr"]
    for _ in range(100):
        summary = OutputSummary()
        printed: dict[int, list[tuple[str, str]]] = {}
        for _ in range(rng.randint(1, 300)):
            rank = rng.randrange(rng.randint(1, 40))
            name = rng.choice(["stdout", "stderr"])
            value = rng.choice(["", str(rng.randint(0, 3)), f"{rng.random():.2f}"])
            line = f"{rng.choice(words)} {value}".strip()
            summary.add(rank, name, [line])
            printed.setdefault(rank, []).append((name, line))
        entries = list(summary.entries())
        assert sum(len(e.ranks) for e in entries) == summary.lines_in == sum(map(len, printed.values()))
        for entry in entries:
            assert list(entry.ranks) == sorted(set(entry.ranks))
            texts = {line for r in entry.ranks for n, line in printed[r] if n == entry.name}
            assert entry.text.split(" (rank ")[0] in texts


def _word(i: int) -> str:
    """A word of letters only, different for each ``i`` (so that every line is its own entry)."""
    out = ""
    while True:
        out += chr(97 + i % 26)
        i //= 26
        if not i:
            return out


def test_what_is_shown_is_bounded_and_the_rest_counted() -> None:
    summary = OutputSummary()
    count = summary_mod.MAX_ENTRIES + 500
    for i in range(count):
        summary.add(i % 7, "stdout", [f"unique {_word(i)}"])
    shown = summary.lines()
    assert len(shown) == summary_mod.MAX_ENTRIES + 1
    assert (
        shown[summary_mod.HEAD_ENTRIES] == "… 500 more lines not shown here (the rank logs have every line)"
    )
    assert shown[0] == "[rank 0] unique a"
    assert shown[-1] == f"[rank {(count - 1) % 7}] unique {_word(count - 1)}"
    assert len(summary.rows()) == summary_mod.MAX_ENTRIES + 1
