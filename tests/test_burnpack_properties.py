"""Property-based round trips: any tensors (every dtype, shapes with zero dimensions), param
ids, scalars and metadata come back identical, and rewriting what was read gives the same
bytes."""

from __future__ import annotations

import math
import struct

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_bpk import burnpack
from lightning_bpk.burnpack import Scalar, TensorEntry

from _burnpack_helpers import _ALL_DTYPES, _entries_in_data_order, _same

# =============================== property-based round trips ====================================


_names = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)


_scalars = st.one_of(
    st.integers(-(2**63), 2**63 - 1).map(Scalar.Int),
    st.integers(0, 2**64 - 1).map(Scalar.UInt),
    st.floats(allow_nan=True, allow_infinity=True).map(Scalar.Float),
    st.booleans().map(Scalar.Bool),
)


_metadata = st.dictionaries(
    _names.filter(lambda k: not k.startswith(burnpack.CHECKSUM_PREFIX)), _names, max_size=4
)


@st.composite
def _tensor(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(_ALL_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    numel = math.prod(shape)
    if dtype == torch.bool:
        return torch.tensor(draw(st.lists(st.booleans(), min_size=numel, max_size=numel))).reshape(
            shape
        )
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize))
    return (
        torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
        if numel
        else torch.empty(shape, dtype=dtype)
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tensors=st.dictionaries(_names, _tensor(), max_size=5),
    param_ids=st.lists(st.one_of(st.none(), st.integers(0, 2**64 - 1)), min_size=5, max_size=5),
    scalars=st.dictionaries(_names, _scalars, max_size=4),
    metadata=_metadata,
    checksums=st.booleans(),
)
def test_property_round_trip(tensors, param_ids, scalars, metadata, checksums):
    entries = {
        name: TensorEntry.from_tensor(t, pid)
        for (name, t), pid in zip(tensors.items(), param_ids, strict=False)
    }
    data = burnpack.dumps(entries, metadata=metadata, scalars=scalars, checksums=checksums)
    assert len(data) == burnpack.size(
        entries, metadata=metadata, scalars=scalars, checksums=checksums
    )
    pack = burnpack.loads(data)
    assert pack.names == sorted(tensors)
    assert pack.metadata == metadata and pack.scalars == scalars
    for k, s in scalars.items():
        if s.kind == "Float":
            assert struct.pack(">d", pack.scalars[k].value) == struct.pack(">d", s.value)
    for (name, t), pid in zip(tensors.items(), param_ids, strict=False):
        assert _same(pack.tensor(name), t)
        assert pack.entries[name].param_id == pid
    rewritten = burnpack.dumps(
        _entries_in_data_order(pack),
        metadata=pack.metadata,
        scalars=pack.scalars,
        checksums=checksums,
    )
    assert rewritten == data
