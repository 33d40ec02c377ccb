"""Per-field work done once per field set: pack templates, layout record templates and the
decoder's cached field sets give exactly what the per-field code gives, and refuse the same."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from delivery_payloads import fill_backend, make_metas, plan_for

from knitkit.storage.backends.memory import MemoryBackend
from knitkit.storage.delivery.layout_codec import LayoutDecodeError, decode_layout, encode_layout
from knitkit.storage.planning import pack_layout
from knitkit.storage.planning.plan import MicroBatchPlan, SequenceSlice, StageLayers, Topology
from knitkit.types import FieldView, MicroBatchLayout

SCHEMA = {"tokens": ("int32", ()), "logprobs": ("float32", ()), "routing": ("uint8", (3, 2))}
SLOT = 1 << 20


@pytest.mark.parametrize(
    ("token_fields", "scalar_fields", "named"),
    [
        (("tokens", "position_ids"), (), "position_ids"),
        (("tokens", "cu_seqlens"), (), "cu_seqlens"),
        (("tokens",), ("cu_seqlens_padded",), "cu_seqlens_padded"),
        (("tokens",), ("loss_mask",), "loss_mask"),
        (("tokens",), ("tokens",), "tokens"),
    ],
)
def test_a_stored_field_named_like_a_generated_one_is_refused(
    token_fields: tuple[str, ...], scalar_fields: tuple[str, ...], named: str
) -> None:
    """A stored field that packing would overwrite with a field it generates (or a per-token and
    a scalar field of one name) is refused by name, instead of being silently replaced by
    position ids or sequence bounds. On 54667bc ``pack_layout`` returned a layout in which the
    stored field was gone."""
    sequence = SequenceSlice("t0", 5, 6, ((0, 6),))
    micro_batch = MicroBatchPlan(0, (sequence,), token_fields, scalar_fields)
    schema = {name: ("int64", ()) for name in (*token_fields, *scalar_fields)}
    with pytest.raises(ValueError, match=re.escape(repr(named))):
        pack_layout(micro_batch, schema)


def test_record_templates_encode_every_micro_batch_as_encode_layout_does() -> None:
    """For every micro-batch of a DP2 x CP2 plan (stored and generated loss mask, whole fields
    and a pipeline stage's layers), the template's layout equals ``pack_layout``'s rebuilt from
    scratch, and its record is ``encode_layout``'s byte for byte, and decodes back to it."""
    from knitkit.storage.delivery.layout_codec import RecordTemplate  # new in issue 31
    from knitkit.storage.planning.packing import pack_template

    metas = make_metas([37, 5, 91, 12, 60, 23])
    fill_backend(MemoryBackend(), metas)
    plan = plan_for(metas, Topology(dp=2, cp=2), 64, "mb")
    stage = StageLayers(((0, 1), (1, 3)), ("routing",))
    schemas = [SCHEMA, {**SCHEMA, "loss_mask": ("float32", ())}]
    checked = 0
    for consumer in plan.consumers:
        for assignment in (consumer, consumer.for_stage(1, stage)):
            for micro_batch in assignment.micro_batches:
                for schema in schemas:
                    fields = (
                        *micro_batch.token_fields,
                        *(("loss_mask",) if "loss_mask" in schema else ()),
                    )
                    micro_batch = MicroBatchPlan(
                        micro_batch.index,
                        micro_batch.sequences,
                        fields,
                        micro_batch.scalar_fields,
                        micro_batch.columns,
                    )
                    template = pack_template(micro_batch, {**schema, "reward": ("float32", ())})
                    shaped = template.shape(micro_batch, {"minibatch_id": "mb", "step": 0.5})
                    layout = MicroBatchLayout.build(
                        {v.name: (v.dtype, v.shape) for v in shaped.layout.fields},
                        cu_seqlens_padded=shaped.layout.cu_seqlens_padded,
                        trajectory_ids=shaped.layout.trajectory_ids,
                        extra=shaped.layout.extra,
                    )
                    assert shaped.layout == layout
                    record = RecordTemplate(template.names, template.dtypes, template.trailing)
                    blob = record.encode(shaped.layout, shaped.offsets, shaped.lead)
                    assert blob == encode_layout(layout)
                    assert decode_layout(blob, SLOT) == layout
                    checked += 1
    assert checked >= 16


def _layout(*fields: FieldView, nbytes: int = 1024) -> MicroBatchLayout:
    return MicroBatchLayout(fields, nbytes, (0, 3), ("t0",), (), {"micro_batch": 1})


GOOD = (FieldView("tokens", "int64", (8,), 0), FieldView("routing", "uint8", (8, 4), 64))


@pytest.mark.parametrize(
    ("fields", "nbytes", "named"),
    [
        (
            (GOOD[0], FieldView("routing", "uint8", (8, 4), 96)),
            1024,
            r"field 'routing'.*offset 96.*cannot be viewed",
        ),
        (
            (GOOD[0], FieldView("routing", "uint8", (2 * SLOT, 4), 64)),
            1 << 62,
            r"nbytes=.*outside the slot",
        ),
        ((GOOD[0], FieldView("routing", "uint8", (SLOT, 4), 64)), SLOT, r"field 'routing'.*past"),
        (
            (GOOD[0], FieldView("routing", "uint8", (8, 4), 32)),
            1024,
            r"'routing'.*cannot be viewed",
        ),
        (
            (FieldView("tokens", "int64", (16,), 0), FieldView("routing", "uint8", (8, 4), 64)),
            1024,
            r"fields '(tokens|routing)' and '(tokens|routing)' overlap",
        ),
        (
            (
                FieldView("tokens", "int64", (8,), 0),
                FieldView("routing", "uint8", (SLOT + 1, 0), 64),
            ),
            1024,
            r"field 'routing'.*cannot be viewed",
        ),
    ],
    ids=["misaligned", "beyond-slot", "past-layout", "inside-a-block", "overlap", "huge-dim"],
)
def test_a_cached_field_set_refuses_what_the_full_check_refuses(
    fields: tuple[FieldView, ...], nbytes: int, named: str
) -> None:
    """Once a field set is cached (a valid record decoded), a record of the same names, dtypes
    and trailing dimensions whose offsets or first dimensions are hostile is still refused,
    naming the field (NOTE [ Field sets decoded once ]); one laid out in another order decodes
    exactly."""
    decode_layout(encode_layout(_layout(*GOOD)), SLOT)  # caches the field set
    with pytest.raises(LayoutDecodeError) as info:
        decode_layout(encode_layout(_layout(*fields, nbytes=nbytes)), SLOT)
    assert re.search(named, str(info.value)), str(info.value)
    reordered = _layout(
        FieldView("tokens", "int64", (8,), 64), FieldView("routing", "uint8", (8, 4), 0)
    )
    assert decode_layout(encode_layout(reordered), SLOT) == reordered


def test_the_decoder_reads_offsets_and_first_dimensions_where_the_record_has_them() -> None:
    """The decoder's two column reads agree with the record's row format (offset, dtype code,
    ndim, six dimensions): a record whose rows are rewritten with other offsets and first
    dimensions decodes to exactly those."""
    layout = _layout(*GOOD)
    blob = bytearray(encode_layout(layout))
    header = struct.calcsize("<4sq7I")
    row = struct.Struct("<QBB6x6Q")
    values = list(row.unpack_from(blob, header + row.size))
    values[0], values[3] = 128, 4  # routing: offset 128, 4 rows
    row.pack_into(blob, header + row.size, *values)
    decode_layout(encode_layout(layout), SLOT)  # the field set is cached
    decoded = decode_layout(bytes(blob), SLOT)
    assert decoded.fields[1] == FieldView("routing", "uint8", (4, 4), 128)
    assert np.dtype(decoded.fields[0].dtype) == np.int64
