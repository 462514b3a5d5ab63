"""The held-out text set of ``python -m bench kv-quant --sections held-out``: at least 8 passages of each of
three kinds, all of full length, none repeated, none from the pydoc topics the quality section reads."""
import torch

from bench.kv_quant_texts import FORCED, PROMPT, held_out_passages


class ByteTokenizer:
    """One token per UTF-8 byte: enough to cut passages without the real tokenizer."""

    def __call__(self, text, return_tensors="pt"):
        ids = torch.tensor(list(text.encode()), dtype=torch.long)[None]
        return type("Encoding", (), {"input_ids": ids})()


def test_three_kinds_of_eight_full_length_distinct_passages():
    passages = held_out_passages(ByteTokenizer())
    kinds = [kind for kind, _, _ in passages]
    assert {kind: kinds.count(kind) for kind in set(kinds)} == {"docstring": 8, "comment": 8, "license": 8}
    assert all(ids.shape == (PROMPT + FORCED,) for _, _, ids in passages)
    texts = {bytes(ids.tolist()) for _, _, ids in passages}
    assert len(texts) == len(passages)
    from pydoc_data.topics import topics
    manual = "\n".join(topics.values()).encode()
    assert not any(text[:64] in manual for text in texts)


def test_comment_passages_are_comments_not_code():
    passages = held_out_passages(ByteTokenizer(), kinds=("comment",), per_kind=8)
    for _, label, ids in passages:
        text = bytes(ids.tolist()).decode(errors="replace")
        assert "def " not in text and "import " not in text.split("\n")[0], label


def test_the_long_prompt_set_has_six_full_length_passages_of_each_kind():
    """``--prompt 480``: license, comments and stdlib code (the middle of a module's source), 6 each."""
    from bench.kv_quant_texts import LONG_KINDS
    passages = held_out_passages(ByteTokenizer(), LONG_KINDS, 6, prompt=480)
    kinds = [kind for kind, _, _ in passages]
    assert {kind: kinds.count(kind) for kind in set(kinds)} == {"license": 6, "comment": 6, "code": 6}
    assert all(ids.shape == (480 + FORCED,) for _, _, ids in passages)
    assert len({bytes(ids.tolist()) for _, _, ids in passages}) == len(passages)
