"""`--afd-micro-batches auto`'s choice: each count tried first, then the fastest per row, the others retried now
and then, per batch-size bucket, never more micro-batches than rows."""

from __future__ import annotations

from kvbaton.engine.micro_batches import MicroBatchChooser


def run(chooser: MicroBatchChooser, rows: int, seconds_per_row: dict[int, float], steps: int) -> list[int]:
    """`steps` decode steps of `rows` rows whose time per row depends only on the count chosen."""
    picked = []
    for _ in range(steps):
        m = chooser.pick(rows)
        chooser.record(rows, m, seconds_per_row[m] * rows)
        picked.append(m)
    return picked


def test_every_count_is_tried_then_the_fastest_kept():
    chooser = MicroBatchChooser(tries=2, retry_every=1000)
    picked = run(chooser, 32, {1: 3.0, 2: 1.0, 3: 1.5, 4: 2.0}, 40)
    assert sorted(picked[:8]) == [1, 1, 2, 2, 3, 3, 4, 4]
    assert set(picked[8:]) == {2}
    assert chooser.choices() == {32: 2}


def test_the_others_are_retried_and_a_change_is_followed():
    chooser = MicroBatchChooser(tries=1, retry_every=4)
    run(chooser, 16, {1: 1.0, 2: 2.0, 3: 2.0, 4: 2.0}, 4 + 40)
    assert chooser.choices() == {16: 1}
    # the experts' side got slower: splitting pays now, and the retries find it
    picked = run(chooser, 16, {1: 5.0, 2: 1.0, 3: 3.0, 4: 3.0}, 200)
    assert chooser.choices() == {16: 2} and picked[-12:].count(2) >= 9  # a retry every 4th step


def test_buckets_choose_apart_and_small_batches_split_no_further_than_their_rows():
    chooser = MicroBatchChooser(tries=1, retry_every=1000)
    small = run(chooser, 2, {1: 1.0, 2: 2.0, 3: 0.1, 4: 0.1}, 10)
    assert set(small) == {1, 2} and chooser.choices() == {2: 1}
    run(chooser, 60, {1: 2.0, 2: 1.5, 3: 1.0, 4: 1.2}, 10)
    assert chooser.choices() == {2: 1, 64: 3}
    assert MicroBatchChooser.bucket_of(1) == 1 and MicroBatchChooser.bucket_of(33) == 64
