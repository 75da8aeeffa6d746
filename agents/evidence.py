"""The evidence pack an auditor hands to a third party: `gpupool audit export` and `gpupool audit verify-export`.

A pack is one directory for one tenant and one period: a CSV and a JSON file per section (resources, jobs,
decisions, quota, actions, faults, usage, cost), `summary.json` (the period, the tenant's jobs, GPU-hours, cost, and
the result of the replay verification that ran over the period), `verification.json` (that verification's report),
and `manifest.json` (every file's SHA-256 and size, the period, the signer's public key), signed with the pool's
ed25519 evidence key in `manifest.sig`. Times are ISO-8601 UTC. A tenant's pack names no other tenant's job or
principal: explanations are redacted as the API redacts them for that tenant (streams/edge/api.py).

The key: `$GPUPOOL_HOME/keys/evidence-ed25519.pem` (0600), made on first use; its public half is in every manifest and
in `evidence-ed25519.pub.pem` beside it. `verify-export --pubkey FILE` checks the pack against a public key the
receiver got from the pool out of band (the one in the manifest proves integrity, not origin).
"""
from __future__ import annotations

import base64
import csv
import hashlib
import os
from datetime import datetime, timezone
from pathlib import Path

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from streams.edge.api import SCHEDULER_SEQ, priced_usage, redact, usage_where

FORMAT = "gpupool-evidence/1"
SIGNED = ("manifest.json", "manifest.sig")


def iso(ms: int | None) -> str:
    if ms is None or ms < 0:
        return ""
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


# ---------------------------------------------------------------- the key


def key_paths(home: Path) -> tuple[Path, Path]:
    d = home / "keys"
    return d / "evidence-ed25519.pem", d / "evidence-ed25519.pub.pem"


def signing_key(home: Path, path: Path | None = None) -> Ed25519PrivateKey:
    private, public = key_paths(home)
    path = path or private
    if not path.exists():
        if path != private:
            raise SystemExit(f"no signing key at {path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        key = Ed25519PrivateKey.generate()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
        public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                         serialization.PublicFormat.SubjectPublicKeyInfo))
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise SystemExit(f"{path}: not an ed25519 private key")
    return key


def _raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public: Ed25519PublicKey) -> str:
    return hashlib.sha256(_raw(public)).hexdigest()[:16]


# ---------------------------------------------------------------- writing


def _write(out: Path, name: str, columns: list[str], rows: list[list]) -> dict:
    with (out / f"{name}.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows(rows)
    (out / f"{name}.json").write_bytes(orjson.dumps([dict(zip(columns, r)) for r in rows], default=str,
                                                    option=orjson.OPT_INDENT_2))
    return {"rows": len(rows), "columns": columns}


MICRO_PER_GPU_HOUR_DIVISOR = 3_600_000_000  # milli-GPU x ms in one GPU-hour: numerator // this = micro-units


def _window(alias: str, since: int | None, until: int | None) -> str:
    parts = []
    if since is not None:
        parts.append(f"{alias} >= {{since:UInt64}}")
    if until is not None:
        parts.append(f"{alias} < {{until:UInt64}}")
    return " AND ".join(parts) or "1"


def write_pack(client, tenant: str, out: Path, since: int | None, until: int | None, verification: dict,
               key: Ed25519PrivateKey, inventory: list, node_facts: list) -> dict:
    """Write every section, the summary and the signed manifest; returns the summary. `inventory`: the latest
    node.inventory envelope per node; `node_facts`: (topic, partition, offset, envelope) of node-control facts."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        if stale.is_file():
            stale.unlink()
    p = {"t": tenant, "since": since, "until": until}
    mine = "startsWith(job_id, concat({t:String}, '/'))"
    sections: dict[str, dict] = {}

    rows = []
    for env in sorted(inventory, key=lambda e: e.payload.node):
        n = env.payload
        for g in n.gpus:
            rows.append([n.node, n.rack, n.datacenter, g.uuid, g.index, g.model, g.memory_mib, g.mig_enabled,
                         len(g.mig_layout), g.driver_version, g.cuda_version, iso(env.event_time_ms), env.event_id])
    sections["resources"] = _write(out, "resources", [
        "node", "rack", "datacenter", "gpu_uuid", "gpu_index", "gpu_model", "gpu_memory_mib", "mig_enabled",
        "mig_instances", "driver_version", "cuda_version", "inventory_at", "inventory_event_id"], rows)

    cols, rows = client.sql(
        "SELECT event_time_ms, kind, job_id, node, command_id, actor, event_id, topic, partition, offset, payload "
        f"FROM gpupool.events FINAL WHERE {mine} AND {_window('event_time_ms', since, until)} "
        f"ORDER BY event_time_ms, {SCHEDULER_SEQ}, topic, partition, offset", p)
    sections["jobs"] = _write(out, "jobs", ["at", *cols[1:-1], "payload"], [
        [iso(r[0]), *r[1:-1], orjson.dumps(redact(orjson.loads(r[-1]), tenant)).decode()] for r in rows])

    cols, rows = client.sql(
        "SELECT event_time_ms, kind, job_id, command_id, node, event_id, reasons FROM gpupool.scheduling FINAL "
        f"WHERE {mine} AND {_window('event_time_ms', since, until)} ORDER BY event_time_ms, {SCHEDULER_SEQ}, event_id",
        p)
    sections["decisions"] = _write(out, "decisions", ["at", *cols[1:-1], "reasons"], [
        [iso(r[0]), *r[1:-1], orjson.dumps(redact(orjson.loads(r[-1]), tenant)).decode()] for r in rows])

    cols, rows = client.sql(
        "SELECT event_time_ms, kind, project, job_id, quota_milli, used_milli, reserved_milli, borrowed_milli, milli, "
        "overcommit_pct, actor, event_id FROM gpupool.quota_events FINAL "
        f"WHERE tenant = {{t:String}} AND {_window('event_time_ms', since, until)} "
        f"ORDER BY event_time_ms, {SCHEDULER_SEQ}, event_id", p)
    sections["quota"] = _write(out, "quota", ["at", *cols[1:]], [[iso(r[0]), *r[1:]] for r in rows])

    # who did what, when: the tenant's requests (with the authenticated principal) and operators' node actions
    cols, rows = client.sql(
        "SELECT event_time_ms, actor, kind, multiIf(job_id != '', job_id, JSONExtractString(payload, "
        "'reservation_id') != '', JSONExtractString(payload, 'reservation_id'), JSONExtractString(payload, "
        "'service_id') != '', JSONExtractString(payload, 'service_id'), node != '', node, tenant) AS subject, "
        "event_id FROM gpupool.events FINAL WHERE actor != '' AND (tenant = {t:String} OR kind IN ('node.cordon', "
        f"'node.removed', 'gpu.health')) AND {_window('event_time_ms', since, until)} "
        "ORDER BY event_time_ms, event_id", p)
    sections["actions"] = _write(out, "actions", ["at", *cols[1:]], [[iso(r[0]), *r[1:]] for r in rows])

    rows = []
    for topic, part, off, env in node_facts:
        t = env.event_time_ms
        if (since is not None and t < since) or (until is not None and t >= until):
            continue
        q = env.payload
        if env.kind == "gpu.health":
            what = (q.gpu_uuid, "healthy" if q.healthy else "unhealthy", q.reason)
        elif env.kind == "node.liveness":
            what = ("", "alive" if q.alive else "down", f"last heartbeat {iso(q.last_heartbeat_ms)}")
        elif env.kind == "node.cordon":
            what = ("", ("draining" if q.drain else "cordoned") if q.cordoned else "uncordoned", q.reason)
        elif env.kind == "node.removed":
            what = ("", "removed" if q.removed else "re-added", q.reason)
        else:
            continue
        rows.append([iso(t), env.kind, q.node, *what, env.actor or "", env.event_id])
    rows.sort(key=lambda r: (r[0], r[-1]))
    sections["faults"] = _write(out, "faults", ["at", "kind", "node", "gpu_uuid", "state", "reason", "actor",
                                                "event_id"], rows)

    cols, rows = client.sql(
        "SELECT start_ms, end_ms, project, job_id, tier, node, gpu_model, datacenter, gpu_milli, gpu_milli_ms, "
        "cu_milli, cu_milli_ms, borrowed, reserved, attempt, event_id FROM gpupool.usage FINAL "
        f"WHERE tenant = {{t:String}} AND {_window('end_ms', since, until)} ORDER BY end_ms, event_id", p)
    sections["usage"] = _write(out, "usage", ["start", "end", *cols[2:]],
                               [[iso(r[0]), iso(r[1]), *r[2:]] for r in rows])

    # The money: billing's one rule (streams/edge/api.py usage_where, priced_usage): intervals overlapping the period,
    # clipped to it. Each line carries its exact numerator (GPU milli-ms x micro-units per GPU-hour, a string: it
    # outgrows JSON's integers) and a total is one division of the summed numerators -- so a reviewer adding the
    # lines gets `gpupool billing --cost` for the same period to the micro-unit, not a sum of rounded lines.
    where, bp = usage_where(tenant, None, since, until)
    cols, rows = client.sql(
        "SELECT project, gpu_model, borrowed, currency, round(sum(gpu_milli_ms) / 3.6e9, 6) AS gpu_hours, "
        "toInt64(intDiv(sum(toInt128(gpu_milli_ms) * micro_per_gpu_hour), 3600000000)) AS cost_micro, "
        "toString(sum(toInt128(gpu_milli_ms) * micro_per_gpu_hour)) AS numerator, "
        "round(sumIf(gpu_milli_ms, NOT priced) / 3.6e9, 6) AS unpriced_gpu_hours, uniqExact(job_id) AS jobs "
        f"FROM ({priced_usage(where, since, until)}) GROUP BY project, gpu_model, borrowed, currency "
        "ORDER BY project, gpu_model, borrowed, currency", bp)
    sections["cost"] = _write(out, "cost", cols, rows)

    totals = {"gpu_hours": round(sum(r[4] for r in rows), 6),
              "borrowed_gpu_hours": round(sum(r[4] for r in rows if r[2]), 6),
              # money per currency, never summed across currencies (docs/billing.md, "Currency")
              "cost_micro": {cur: sum(int(r[6]) for r in rows if r[3] == cur) // MICRO_PER_GPU_HOUR_DIVISOR
                             for cur in sorted({r[3] for r in rows if r[3]})}}
    jobs = {r[2] for r in client.sql(f"SELECT event_time_ms, kind, job_id FROM gpupool.events FINAL WHERE {mine} "
                                     f"AND kind = 'job.requested' AND {_window('event_time_ms', since, until)}",
                                     p)[1]}
    summary = {"format": FORMAT, "tenant": tenant, "period": {"from": iso(since), "to": iso(until)},
               "jobs": len(jobs), **totals, "currency_micro_units": True,
               "verification": {"ok": verification["ok"], "ran_at": verification["ran_at"],
                                "outputs_compared": verification["outputs_compared"],
                                "usage_rows_compared": verification["usage_compared"]},
               "sections": {k: v["rows"] for k, v in sections.items()}}
    (out / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    (out / "verification.json").write_bytes(orjson.dumps(verification, option=orjson.OPT_INDENT_2))
    sign(out, key, {"format": FORMAT, "tenant": tenant, "period": summary["period"],
                    "created_at": iso(_now_ms()), "sections": sections})
    return summary


def _now_ms() -> int:
    import time

    return time.time_ns() // 1_000_000


def sign(out: Path, key: Ed25519PrivateKey, head: dict) -> None:
    files = {}
    for path in sorted(out.iterdir()):
        if path.is_file() and path.name not in SIGNED:
            data = path.read_bytes()
            files[path.name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    public = key.public_key()
    manifest = {**head, "files": files, "signer": {
        "algorithm": "ed25519", "public_key": base64.b64encode(_raw(public)).decode(), "key_id": key_id(public)}}
    body = orjson.dumps(manifest, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
    (out / "manifest.json").write_bytes(body)
    (out / "manifest.sig").write_text(base64.b64encode(key.sign(body)).decode() + "\n")


# ---------------------------------------------------------------- verifying


def verify_pack(directory: Path, pubkey: Path | None = None) -> list[str]:
    """What is wrong with a pack (empty: nothing): each problem names the file or the signature."""
    problems: list[str] = []
    try:
        body = (directory / "manifest.json").read_bytes()
        manifest = orjson.loads(body)
        sig = base64.b64decode((directory / "manifest.sig").read_text().strip())
    except (OSError, ValueError) as exc:
        return [f"manifest: unreadable ({exc})"]
    if pubkey is not None:
        key = serialization.load_pem_public_key(pubkey.read_bytes())
        if not isinstance(key, Ed25519PublicKey):
            return [f"{pubkey}: not an ed25519 public key"]
        if base64.b64encode(_raw(key)).decode() != manifest.get("signer", {}).get("public_key"):
            problems.append(f"signer: the manifest names key {manifest.get('signer', {}).get('key_id')}, "
                            f"not {key_id(key)} ({pubkey})")
    else:
        key = Ed25519PublicKey.from_public_bytes(base64.b64decode(manifest["signer"]["public_key"]))
    try:
        key.verify(sig, body)
    except InvalidSignature:
        problems.append("signature: manifest.sig does not match manifest.json")
    listed = manifest.get("files", {})
    for name, want in sorted(listed.items()):
        path = directory / name
        if not path.exists():
            problems.append(f"missing: {name}")
        elif hashlib.sha256(path.read_bytes()).hexdigest() != want["sha256"]:
            problems.append(f"changed: {name}")
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name not in listed and path.name not in SIGNED:
            problems.append(f"extra: {path.name}")
    return problems
