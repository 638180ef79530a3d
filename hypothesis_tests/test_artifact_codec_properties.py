"""The vectorised quantizer against the scalar §2.7 transcription, over arbitrary finite float32 matrices."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ninfer.artifact import FP32, ArtifactError, decode, encode
from ninfer.artifact.formats import QUANT_FORMATS
from tests.test_artifact_oracle import dequantize_row_split, encode_row_split

finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
# mostly ordinary magnitudes, with subnormals, huge values and exact small integers mixed in
elements = st.one_of(
    st.floats(-10.0, 10.0, width=32),
    st.sampled_from([0.0, -0.0, 0.5, -2.5, 7.0, 1e-7, 1.4e-45, 60000.0]),
    finite_f32,
)
matrices = hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, max_side=140), elements=elements)


@settings(max_examples=150, deadline=None)
@given(array=matrices, fmt=st.sampled_from(sorted(QUANT_FORMATS)))
def test_quantizer_matches_the_scalar_transcription(array, fmt):
    try:
        expected = encode_row_split(array.tolist(), fmt)
    except OverflowError:
        expected = None
    try:
        encoded = encode(array, fmt)
    except ArtifactError as err:
        assert expected is None and err.rule == "scale-range"
        return
    assert encoded == expected
    decoded = decode(encoded, fmt, array.shape)
    assert np.array_equal(decoded, np.array(dequantize_row_split(encoded, fmt, *array.shape), dtype=np.float32))


@settings(max_examples=100, deadline=None)
@given(array=hnp.arrays(np.float32, hnp.array_shapes(min_dims=0, max_dims=5, max_side=4)))
def test_fp32_round_trip_is_bit_exact(array):
    back = decode(encode(array, FP32), FP32, array.shape)
    assert back.tobytes() == array.tobytes()
