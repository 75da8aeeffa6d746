"""Wire helpers for the edges: orjson as a Faust codec, view (de)serialization for changelog-backed tables,
and dead-letter records."""
from __future__ import annotations

import base64
from typing import Any

import orjson
from faust.serializers import codecs
from pydantic import TypeAdapter

from streams.folds.job_view import JobView
from streams.folds.node_view import NodeView


NODE_VIEW = TypeAdapter(NodeView)
JOB_VIEW = TypeAdapter(JobView)


class ViewCodec(codecs.Codec):
    """The Faust codec of the tables: they hold the immutable views themselves, and only their changelog records are
    serialized (orjson, like every other record on the wire), so the fold converts nothing on its hot path."""

    def __init__(self, adapter: TypeAdapter, **kwargs):
        self.adapter = adapter
        super().__init__(**kwargs)

    def _dumps(self, obj: Any) -> bytes:
        return orjson.dumps(self.adapter.dump_python(obj, mode="json"))

    def _loads(self, s: bytes) -> Any:
        return self.adapter.validate_python(orjson.loads(s))


codecs.register("node-view", ViewCodec(NODE_VIEW))
codecs.register("job-view", ViewCodec(JOB_VIEW))


def load_view(adapter: TypeAdapter, doc: dict | None):
    """A view from a changelog record's decoded JSON (readers outside Faust: tests, audit)."""
    return None if doc is None else adapter.validate_python(doc)


DEAD_LETTER_KEEP_BYTES = 256 * 1024  # an oversized original must not make its dead letter oversized too


def dead_letter(reason: str, detail: str, topic: str, partition: int, offset: int, raw: bytes | None) -> bytes:
    raw = raw or b""
    return orjson.dumps({
        "reason": reason, "detail": detail[:2000], "topic": topic, "partition": partition, "offset": offset,
        "original_size": len(raw), "truncated": len(raw) > DEAD_LETTER_KEEP_BYTES,
        "original_b64": base64.b64encode(raw[:DEAD_LETTER_KEEP_BYTES]).decode(),
    })
