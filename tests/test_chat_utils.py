"""Chat messages for the chat template (``entrypoints/chat_utils``): text parts joined with newlines as
vLLM does, null content as "", and a clear ValueError for what a text-only model cannot take."""

import pytest

from longflash.entrypoints.chat_utils import normalize_messages


def test_text_parts_are_joined_with_newlines_and_other_keys_kept():
    msgs = [{"role": "system", "content": None},
            {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}], "name": "u"}]
    assert normalize_messages(msgs) == [{"role": "system", "content": ""},
                                        {"role": "user", "content": "A\nB", "name": "u"}]
    assert msgs[1]["content"][0] == {"type": "text", "text": "A"}  # the input is not modified


@pytest.mark.parametrize("msgs, match", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    (["hi"], "message 0 must be a dict"),
    ([{"role": "wizard", "content": "x"}], "message 0: role must be one of"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "message 1: content part type 'image_url' is not supported"),
    ([{"role": "user", "content": [{"type": "text"}]}], "content part 0 \\(type 'text'\\) needs a string 'text'"),
    ([{"role": "user", "content": [{"text": "hi"}]}], "content part 0 must be"),
    ([{"role": "user", "content": 5}], "content must be a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}], "not valid Unicode"),
])
def test_bad_messages_are_named(msgs, match):
    with pytest.raises(ValueError, match=match):
        normalize_messages(msgs)
