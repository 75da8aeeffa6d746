"""JSON Schema of every event, for producers in other languages (docs/events/). `python -m schemas.jsonschema DIR`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from schemas.envelope import Envelope
from schemas.events import KINDS


def documents() -> dict[str, dict]:
    docs = {"envelope.schema.json": Envelope.model_json_schema()}
    for kind, model in sorted(KINDS.items()):
        docs[f"{kind}.schema.json"] = model.model_json_schema()
    return docs


def render(doc: dict) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def export(directory: str | Path) -> list[Path]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, doc in documents().items():
        path = out / name
        path.write_text(render(doc))
        written.append(path)
    return written


if __name__ == "__main__":
    for p in export(sys.argv[1] if len(sys.argv) > 1 else "docs/events"):
        print(p)
