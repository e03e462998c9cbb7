"""Final and turn rewards: SQuAD normalisation, F1, plates, call keys, evidence, shaping components."""

from __future__ import annotations

import dataclasses

import pytest

from training.rewards import (
    TurnFacts,
    TurnRewardWeights,
    call_key,
    contains_evidence,
    edit_distance,
    exact_match,
    normalize_answer,
    normalize_plate,
    plate_match,
    plate_similarity,
    token_f1,
    turn_reward,
)


def test_normalize_answer_follows_squad() -> None:
    """Lowercase, punctuation and articles gone, whitespace collapsed, as in the SQuAD v1.1 script."""
    assert normalize_answer("  The Eiffel-Tower,  in   PARIS! ") == "eiffeltower in paris"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words


def test_exact_match_ignores_case_punctuation_and_articles() -> None:
    """Surface differences do not cost an exact match; a different answer does."""
    assert exact_match("the Paris.", "Paris") == 1.0
    assert exact_match("Paris, France", "Paris") == 0.0


def test_token_f1_hand_computed() -> None:
    """F1 from token overlap: pred 'new york city' vs gold 'york city' -> P=2/3, R=1, F1=0.8."""
    assert token_f1("New York City", "york city") == pytest.approx(0.8)
    assert token_f1("london", "paris") == 0.0
    assert token_f1("x y y", "y z z") == pytest.approx(1 / 3)  # the shared 'y' counts once: P = R = 1/3


def test_token_f1_empty_sides() -> None:
    """An empty normalised answer scores 1 only against an empty gold answer (SQuAD's convention)."""
    assert token_f1("", "the") == 1.0
    assert token_f1("", "paris") == 0.0
    assert token_f1("paris", "") == 0.0


def test_plate_normalisation_keeps_only_letters_and_digits() -> None:
    """Separators and case vanish; look-alike characters are not mapped (O stays O, 0 stays 0)."""
    assert normalize_plate(" ab-123 cd ") == "AB123CD"
    assert plate_match("ab 123-cd", "AB-123-CD") == 1.0
    assert plate_match("AB I23 CD", "AB-123-CD") == 0.0
    assert plate_match("", "AB-123-CD") == 0.0


def test_plate_match_rejects_empty_gold() -> None:
    """A gold plate with no characters is a data bug and raises instead of scoring."""
    with pytest.raises(ValueError, match="no letters or digits"):
        plate_match("AB123", " - ")


def test_edit_distance_counts_single_character_edits() -> None:
    """Levenshtein distance, hand-checked: substitution, insertion, deletion, empty sides, the classic pair."""
    assert edit_distance("ABC", "ABC") == 0
    assert edit_distance("ABC", "ABD") == 1
    assert edit_distance("ABC", "ABXC") == 1 and edit_distance("ABXC", "ABC") == 1
    assert edit_distance("", "ABC") == 3 and edit_distance("ABC", "") == 3 and edit_distance("", "") == 0
    assert edit_distance("KITTEN", "SITTING") == 3


def test_plate_similarity_grades_a_reading() -> None:
    """Identical plates score 1 (after normalisation, as plate_match), one substitution in 6 scores 5/6, a longer
    reading is divided by its own length, an empty reading scores 0, an empty gold raises."""
    assert plate_similarity("yg9-x2g", "YG9X2G") == 1.0 == plate_match("yg9-x2g", "YG9X2G")
    assert plate_similarity("YG9X26", "YG9X2G") == pytest.approx(5 / 6)
    assert plate_similarity("YG9X2GGG", "YG9X2G") == pytest.approx(1 - 2 / 8)
    assert plate_similarity("", "YG9X2G") == 0.0 and plate_similarity("--", "YG9X2G") == 0.0
    with pytest.raises(ValueError, match="no letters or digits"):
        plate_similarity("ABC", " - ")


def test_call_key_normalises_strings_and_key_order() -> None:
    """Calls that ask the same thing share a key; different tools or arguments do not."""
    a = call_key("search", {"query": " Eiffel Tower ", "k": 3})
    b = call_key("search", {"k": 3, "query": "eiffel tower"})
    assert a == b
    assert a != call_key("search", {"query": "eiffel tower", "k": 4})
    assert a != call_key("page_qa", {"query": "eiffel tower", "k": 3})
    nested = call_key("image_ops", {"ops": [{"op": " CROP ", "box": [1, 2, 3, 4]}]})
    assert nested == call_key("image_ops", {"ops": [{"box": [1, 2, 3, 4], "op": "crop"}]})


def test_call_key_raises_on_non_json_arguments() -> None:
    """A value JSON cannot encode is a bug upstream and must surface."""
    with pytest.raises(TypeError):
        call_key("search", {"query": object()})


def test_contains_evidence_matches_whole_normalised_tokens() -> None:
    """The gold answer counts as found only as whole tokens of the normalised observation."""
    assert contains_evidence("It was built in 1889, by Eiffel.", "1889")
    assert contains_evidence("Capital: PARIS (France)", "the Paris")
    assert not contains_evidence("It was built in 1889.", "188")
    assert not contains_evidence("anything at all", "The")  # empty after normalisation


def test_turn_reward_components_and_total() -> None:
    """Each component is reported on its own; the valid-call bonus is paid once, penalties per call."""
    w = TurnRewardWeights()
    parts = turn_reward(TurnFacts(n_valid_calls=3, n_malformed=2, n_repeated=1, new_evidence=True), w)
    assert parts.valid_call == pytest.approx(0.05)
    assert parts.malformed_call == pytest.approx(-0.10)
    assert parts.repeated_call == pytest.approx(-0.05)
    assert parts.new_evidence == pytest.approx(0.1)
    assert parts.total == pytest.approx(0.0)
    metrics = parts.metrics()
    names = ("valid_call", "malformed_call", "repeated_call", "new_evidence", "recorded_item", "info_gain")
    assert set(metrics) == {f"turn_reward/{k}" for k in (*names, "total")}
    assert metrics["turn_reward/total"] == parts.total


def test_recorded_items_pay_their_share_of_the_weight() -> None:
    """Recording items pays recorded_item times the recorded score (already divided by the item count)."""
    parts = turn_reward(TurnFacts(1, 0, 0, False, recorded_score=0.25), TurnRewardWeights(recorded_item=0.5))
    assert parts.recorded_item == pytest.approx(0.125) and parts.total == pytest.approx(0.175)


def test_turn_reward_nothing_happened_is_zero() -> None:
    """A turn with no calls and no evidence earns nothing (e.g. the final-answer turn)."""
    parts = turn_reward(TurnFacts(0, 0, 0, False), TurnRewardWeights())
    assert (parts.valid_call, parts.malformed_call, parts.repeated_call, parts.new_evidence) == (0, 0, 0, 0)


def test_turn_reward_is_small_next_to_final_reward() -> None:
    """The best a single turn can earn stays far below a correct answer (1.0): shaping cannot dominate."""
    best = turn_reward(
        TurnFacts(n_valid_calls=10, n_malformed=0, n_repeated=0, new_evidence=True), TurnRewardWeights()
    )
    assert best.total == pytest.approx(0.15)


def test_turn_facts_reject_negative_counts() -> None:
    """Negative call counts are a bug in the caller."""
    with pytest.raises(ValueError, match=">= 0"):
        TurnFacts(n_valid_calls=-1, n_malformed=0, n_repeated=0, new_evidence=False)


def test_turn_reward_weights_are_frozen_and_documented() -> None:
    """Weights cannot be mutated mid-run, and each default is the documented value."""
    w = TurnRewardWeights()
    assert (w.valid_call, w.malformed_call, w.repeated_call, w.new_evidence) == (0.05, -0.05, -0.05, 0.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.valid_call = 1.0  # type: ignore[misc]


def test_overlap_f1_counts_shared_words_with_multiplicity() -> None:
    """The one word-overlap F1 (conductor/answers.py) that rewards and the reader's span alignment share: a
    repeated word counts once per occurrence on both sides, and no shared word or an empty list gives 0.0."""
    from conductor.answers import overlap_f1

    assert overlap_f1(["paris", "paris"], ["paris"]) == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert overlap_f1(["new", "york"], ["york", "new"]) == 1.0
    assert overlap_f1([], ["paris"]) == 0.0 and overlap_f1(["rome"], ["paris"]) == 0.0
