"""peagle_ext.data.loops: which answers end in a repetition loop."""

import pytest

from peagle_ext.data import loops as L


def test_a_phrase_repeated_to_the_cap_is_a_loop_even_cut_mid_phrase():
    phrase = "I'm a chatbot designed to assist you, whether it's a problem you're facing."
    text = "Sure. " + " ".join([phrase] * 4) + " I'm a chatbot designed"
    assert L.ends_in_loop(text)
    assert L.loop_period(text.split()) == len(phrase.split())


def test_repeated_list_items_are_a_loop():
    item = "• Conducting audits to ensure compliance with regulatory requirements."
    text = "Duties:\n• Managing budgets for the team.\n" + "\n".join([item] * 5) + "\n"
    assert L.repeated_line_share(text) == pytest.approx(5 / 7)
    assert L.ends_in_loop(text)


def test_ordinary_answers_and_short_repeats_are_not_loops():
    assert not L.ends_in_loop("Paris is the capital of France. It lies on the Seine and has about two million people.")
    assert not L.ends_in_loop("No, no, no, no.")  # a period of one word
    assert not L.ends_in_loop("a b a b")  # two repeats, not three
    assert not L.ends_in_loop("}\n}\n}\n}\nreturn x")  # short lines repeat in code
    assert not L.ends_in_loop("")


def test_three_repeats_at_the_end_are_needed():
    assert L.loop_period("x y a b a b a b".split()) == 2
    assert L.loop_period("a b a b a b x".split()) == 0  # the loop does not reach the end
    longest = [str(i) for i in range(L.MAX_PERIOD_WORDS)]
    assert L.loop_period(longest * 3) == L.MAX_PERIOD_WORDS
    assert L.loop_period([str(i) for i in range(L.MAX_PERIOD_WORDS + 1)] * 3) == 0


def test_conversation_loops_reads_only_assistant_turns():
    loop = "again and again " * 5
    assert L.conversation_loops([{"role": "user", "content": "hi"}, {"role": "assistant", "content": loop}])
    assert not L.conversation_loops([{"role": "user", "content": loop}, {"role": "assistant", "content": "Hello!"}])
    assert not L.conversation_loops([{"role": "assistant", "content": None}])


def test_text_must_be_a_string():
    with pytest.raises(TypeError, match="text must be a str"):
        L.ends_in_loop(None)


def test_cut_loop_keeps_the_repeated_unit_once():
    phrase = "I'm a chatbot designed to assist you, whether it's a problem you're facing."
    text = "Sure. " + " ".join([phrase] * 4) + " I'm a chatbot designed"
    assert L.cut_loop(text) == "Sure. " + phrase
    assert L.cut_loop("x y a b a b a b") == "x y a b"
    item = "• Conducting audits to ensure compliance with regulatory requirements."
    head = "Duties:\n• Managing budgets for the team.\n"
    assert L.cut_loop(head + "\n".join([item] * 5) + "\n") == head + item


def test_cut_loop_leaves_answers_that_do_not_loop():
    for text in ("Paris is the capital of France.", "No, no, no, no.", "a b a b", "}\n}\n}\n}\nreturn x", ""):
        assert L.cut_loop(text) == text


@pytest.mark.parametrize("seed", range(20))
def test_cut_loop_is_a_prefix_that_does_not_loop(seed):
    import random

    rng = random.Random(seed)
    vocab = ["alpha", "beta", "gamma", "delta", "the", "a", "of", "and", "x", "y", "\n", "- item"]
    prefix = " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 30)))
    unit = " ".join(rng.choice(vocab) for _ in range(rng.randint(1, L.MAX_PERIOD_WORDS + 2)))
    text = prefix + " " + " ".join([unit] * rng.randint(1, 6)) + " " + unit[: rng.randint(0, len(unit))]
    cut = L.cut_loop(text)
    assert text.startswith(cut)
    assert not L.ends_in_loop(cut)
    assert (cut == text) == (not L.ends_in_loop(text))


def test_cut_loop_text_must_be_a_string():
    with pytest.raises(TypeError, match="text must be a str"):
        L.cut_loop(b"bytes")
