"""Envelopes stored as the live pool stores them, without a broker: each on its home topic through the real sink, and
the job view's changelog -- each change the worker's fold made -- through the same sink into gpupool.jobs, where the
API, the CLI and the dashboard read a job's state (docs/jobs.md, "A job's state")."""
from __future__ import annotations

from collections import defaultdict

import orjson

from schemas.envelope import encode
from schemas.routing import route
from schemas.topics import DECISIONS, JOB_EVENTS, JOB_REQUESTS, JOB_VIEW_CHANGELOG
from streams.edge.codec import JOB_VIEW
from streams.folds import job_view
from tests.test_sink_exactness import Rec

def chdb_sink(path):
    """A sink writing into an embedded ClickHouse under `path`, with no broker: (its client, the sink)."""
    from infra.clickhouse import connect
    from infra.config import Config
    from streams.edge.sink import Sink

    client = connect(f"chdb://{path / 'clickhouse'}")
    sink = Sink(Config(home=path, kafka=None, clickhouse=f"chdb://{path / 'clickhouse'}", kafka_port=0, web_port=0),
                None)
    sink.client = client
    return client, sink


JOB_TOPICS = (JOB_REQUESTS.name, JOB_EVENTS.name, DECISIONS.name)  # what the worker's job fold reads


class Changelog:
    """The worker's job table and its changelog: the fold's view after each change, at the next offset (one
    sequence of offsets, as one partition's are for one job)."""

    def __init__(self):
        self.views: dict = {}
        self.next_offset = 0

    def records(self, envs, part: int = 0) -> list[Rec]:
        out = []
        for env in envs:
            job_id = getattr(env.payload, "job_id", None)
            if not job_id or route(env)[0].name not in JOB_TOPICS:
                continue
            after = job_view.evolve(self.views.get(job_id), env)
            if after is not self.views.get(job_id):
                self.views[job_id] = after
                out.append(Rec(JOB_VIEW_CHANGELOG.name, part, self.next_offset,
                               orjson.dumps(JOB_VIEW.dump_python(after, mode="json")), job_id.encode()))
                self.next_offset += 1
        return out


def store(sink, changelog: Changelog, envs, part: int = 0) -> None:
    """The envelopes as the sink would get them: each on its home topic, on partition `part`, at the next offset;
    then the job view's changes they made."""
    by_tp: dict[tuple[str, int], list[Rec]] = defaultdict(list)
    for env in envs:
        spec, key = route(env)
        tp = (spec.name, part)
        by_tp[tp].append(Rec(spec.name, part, len(by_tp[tp]), encode(env), key))
    for (topic, p), recs in by_tp.items():
        sink._insert_batch(topic, p, recs)
    changes = changelog.records(envs, part)
    if changes:
        sink._insert_batch(JOB_VIEW_CHANGELOG.name, part, changes)
