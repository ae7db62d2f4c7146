"""Prompt-lookup index: latest, longest suffix match; drafts may continue into the suffix."""
from __future__ import annotations

from guided.engine.ngram import NgramIndex


def index(tokens: list[int]) -> NgramIndex:
    idx = NgramIndex()
    idx.extend(tokens)
    return idx


def test_latest_occurrence_of_the_longest_match_wins():
    #            0  1  2  3  4  5  6  7  8  9 10
    idx = index([1, 2, 3, 9, 5, 2, 3, 7, 8, 1, 2, 3])
    # "1 2 3" occurs at 0..2 (followed by 9); "2 3" also at 5..6 (followed by 7): longest wins
    assert idx.lookup([], min_n=2, max_n=3, k=2) == [9, 5]
    # limited to 2-grams, the latest "2 3" wins
    assert idx.lookup([], min_n=2, max_n=2, k=3) == [7, 8, 1]


def test_no_match_shorter_than_min_n():
    idx = index([4, 5, 6, 1, 7, 8, 1])
    assert idx.lookup([], min_n=2, max_n=4, k=3) == []
    assert idx.lookup([], min_n=1, max_n=4, k=2) == [7, 8]


def test_suffix_extends_the_context():
    idx = index([10, 11, 12, 13, 14, 20])
    # the context ends with the (uncommitted) suffix 11, 12
    assert idx.lookup([11, 12], min_n=2, max_n=4, k=3) == [13, 14, 20]
    # a continuation may run into the suffix itself (a repeating pattern)
    idx = index([7, 8, 7, 8])
    assert idx.lookup([7], min_n=2, max_n=4, k=4) == [8, 7]


def test_sync_indexes_only_new_tokens():
    idx = NgramIndex()
    prompt, output = [1, 2, 3], []
    idx.sync(prompt, output)
    output += [1, 2]
    idx.sync(prompt, output)
    assert idx.tokens == [1, 2, 3, 1, 2]
    assert idx.positions[1] == [0, 3]
    assert idx.lookup([], min_n=2, max_n=4, k=5) == [3, 1, 2]


def test_k_zero_and_empty():
    assert index([]).lookup([], min_n=1, max_n=3, k=4) == []
    assert index([1, 1]).lookup([], min_n=1, max_n=3, k=0) == []


def test_a_draft_stops_at_a_barrier_token():
    idx = NgramIndex(barrier=frozenset({0}))
    idx.extend([5, 6, 7, 0, 8, 5, 6])
    assert idx.lookup([], min_n=2, max_n=4, k=4) == [7]
