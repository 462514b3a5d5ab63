"""``StopStrings``: the one rule the engine (finish on a stop string) and the server (cut before it,
hold back a possible beginning while streaming) share."""
from __future__ import annotations

from hf_paged.engine.stop_strings import StopStrings


class Bytes:
    """A byte-level tokenizer: token t is the byte t (a character takes up to 4 tokens)."""

    def decode(self, ids, **_):
        return bytes(ids).decode("utf-8", errors="replace")


class Letters:
    """A tokenizer whose token t is the letter chr(ord('a') + t)."""

    def decode(self, ids, **_):
        return "".join(chr(ord("a") + t) for t in ids)


def test_first_cut_and_hold():
    stops = StopStrings(("cd", "bcx", "z"))
    assert stops and stops.hold == 2 and stops.window == 5
    assert stops.first("abcdz") == 2 and stops.first("abc") is None
    assert stops.cut("abcdz") == ("ab", True) and stops.cut("abc") == ("abc", False)
    none = StopStrings()
    assert not none and none.hold == 0 and none.cut("abc") == ("abc", False)
    assert stops.earliest("abcdz") == (2, "cd") and StopStrings(("abc", "ab")).earliest("xabc") == (1, "abc")
    assert stops.in_tail(Letters(), [0, 1, 2, 3, 25], 5) == "cd" and stops.in_tail(Letters(), [0, 1], 2) is None


def test_in_tail_reads_only_the_last_window_of_new_tokens():
    stops = StopStrings(("cd",))                     # window: 2 + 2 = 4 tokens
    tok = Letters()
    assert stops.in_tail(tok, [0, 1, 2, 3], 4)        # "abcd"
    assert not stops.in_tail(tok, [0, 1, 2, 4], 4)
    assert not stops.in_tail(tok, [2, 3, 0, 0, 0, 0], 6)  # "cd" fell out of the window
    assert stops.in_tail(tok, [0, 0, 2, 3, 0, 0], 6)
    assert not stops.in_tail(tok, [2, 3, 0], 1)       # "cd" is the prompt's: only the new tokens' text counts
    assert not stops.in_tail(tok, [2, 3, 0], 2)       # nor one that begins in the prompt
    assert stops.in_tail(tok, [0, 2, 3], 2)


def test_cut_after_a_boundary():
    stops = StopStrings(("cd", "x"))
    assert stops.cut("abcdx", after=3) == ("ab", True)       # "cd" ends at 4 > 3
    assert stops.cut("abcdx", after=4) == ("abcd", True)     # only "x" ends after 4
    assert stops.cut("abcdx", after=5) == ("abcdx", False)
    assert stops.cut("abcdx", keep=True, after=4) == ("abcdx", True)


def test_in_tail_finds_a_stop_string_of_many_tokens_per_character():
    """The window counts bytes: "終わり" is 3 characters but 9 byte tokens (found at the token that completes it;
    a window of characters + 2 never saw it whole). Also after a prompt ending inside a character."""
    tok = Bytes()
    for stop, text in (("終わり", "x 終わり, then more"), ("🦜!", "ok 🦜! go"), ("ñ", "señor")):
        prompt = list("Say: ".encode()) + [0xE7]               # ends with a lone lead byte
        new = list(text.encode())
        end = len(text[:text.index(stop) + len(stop)].encode())
        found = [k for k in range(1, len(new) + 1) if StopStrings((stop,)).in_tail(tok, prompt + new[:k], k)]
        assert found and found[0] == end, (stop, found[:3], end)
