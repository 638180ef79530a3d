"""Whatever the text and stops, the streamed deltas concatenate to the one-shot answer."""

from hypothesis import given, settings, strategies as st

from ninfer.frontend.output import OutputDecoder
from tests.test_output_decoder import STOP_ID, ByteTokenizer, run

alphabet = st.sampled_from(["a", "b", "E", "N", "D", " ", "\n", "☃", "é", "</think>"])


def one_shot(text: str, thinking: bool, stops: tuple[str, ...]):
    reasoning, content = "", text
    if thinking:
        reasoning, sep, content = text.partition("</think>")
        if not sep:
            return min_cut(reasoning, ()), ""
        content = content.lstrip()
    return reasoning, min_cut(content, stops)


def min_cut(text: str, stops: tuple[str, ...]) -> str:
    hits = [text.find(s) for s in stops if s in text]
    return text[: min(hits)] if hits else text


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(alphabet, max_size=30), thinking=st.booleans(),
       stops=st.lists(st.sampled_from(["END", "N", "a b", "☃é"]), max_size=2, unique=True))
def test_streamed_deltas_equal_the_one_shot_split(pieces, thinking, stops):
    text = "".join(pieces)
    tokens = list(text.encode()) + [STOP_ID]
    reasoning, content, _ = run(OutputDecoder(ByteTokenizer(), thinking=thinking, stop_ids={STOP_ID},
                                              stop_strings=tuple(stops)), tokens)
    assert (reasoning, content) == one_shot(text, thinking, tuple(stops))
