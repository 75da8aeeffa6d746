"""A node agent's Prometheus metrics, on a small HTTP endpoint bound to 127.0.0.1 (`gpupool agent --metrics-port N`
or GPUPOOL_AGENT_METRICS_PORT; 0, the default, serves none). What the agent itself knows: the latest telemetry of each
card and MIG instance (DCGM-like gauges in base units), the records it published, the commands it received, the jobs
it runs, its programs' output taken and cut by the log caps. docs/observability.md lists them. No token: like
node_exporter, it answers on loopback only."""
from __future__ import annotations

import logging
from typing import Callable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from schemas.events import GpuTelemetry

log = logging.getLogger("gpupool.agent.metrics")
MIB = 1024 * 1024


class AgentMetrics:
    def __init__(self, running: Callable[[], dict[str, int]] = dict):
        self.registry = CollectorRegistry(auto_describe=True)
        self.published = Counter("gpupool_node_records_published", "Records the agent published, by kind", ["kind"],
                                 registry=self.registry)
        self.commands = Counter("gpupool_node_commands", "Commands the agent received, by kind", ["kind"],
                                registry=self.registry)
        # programs' output (agents/node/logship.py): what the caps let through, and what they cut
        self.log_bytes = Counter("gpupool_node_log_bytes", "Bytes of programs' output taken for job.log, by stream",
                                 ["stream"], registry=self.registry)
        self.log_dropped = Counter("gpupool_node_log_dropped_bytes", "Bytes of programs' output cut by the log caps, "
                                   "by cap: rate, size (per run), buffer (unsent), no_node", ["cap"],
                                   registry=self.registry)
        self.latest: dict[str, GpuTelemetry] = {}  # node -> its last telemetry
        self.running = running  # node -> jobs running there
        self.registry.register(self)

    def observe(self, payload) -> None:
        """Called with every payload the agent publishes."""
        self.published.labels(payload.kind).inc()
        if isinstance(payload, GpuTelemetry):
            self.latest[payload.node] = payload

    def describe(self):
        return []

    def collect(self):
        names = ("gpu", "mig", "node")
        fams = {
            "util": GaugeMetricFamily("gpupool_node_gpu_utilization_ratio", "GPU (or MIG instance) utilization, "
                                      "0..1, the last sample", labels=list(names)),
            "mem": GaugeMetricFamily("gpupool_node_gpu_memory_used_bytes", "GPU memory used", labels=list(names)),
            "total": GaugeMetricFamily("gpupool_node_gpu_memory_total_bytes", "GPU memory", labels=list(names)),
            "temp": GaugeMetricFamily("gpupool_node_gpu_temperature_celsius", "GPU temperature", labels=list(names)),
            "power": GaugeMetricFamily("gpupool_node_gpu_power_watts", "GPU power draw", labels=list(names)),
            "jobs": GaugeMetricFamily("gpupool_node_gpu_jobs", "Jobs the last sample names on the card or instance",
                                      labels=list(names)),
            "ecc": CounterMetricFamily("gpupool_node_gpu_ecc_errors", "ECC errors the card counted, by type",
                                       labels=[*names, "type"]),
        }
        for node, tel in sorted(self.latest.items()):
            for s in tel.samples:
                key = [s.gpu_uuid, s.mig_uuid or "", node]
                fams["util"].add_metric(key, s.util_pct / 100)
                fams["mem"].add_metric(key, s.mem_used_mib * MIB)
                fams["total"].add_metric(key, s.mem_total_mib * MIB)
                fams["temp"].add_metric(key, s.temperature_c)
                fams["power"].add_metric(key, s.power_mw / 1000)
                fams["jobs"].add_metric(key, len(s.job_ids))
                fams["ecc"].add_metric([*key, "corrected"], s.ecc_corrected)
                fams["ecc"].add_metric([*key, "uncorrected"], s.ecc_uncorrected)
        yield from fams.values()
        g = GaugeMetricFamily("gpupool_node_jobs_running", "Jobs the agent runs, by node", labels=["node"])
        for node, n in sorted(self.running().items()):
            g.add_metric([node], n)
        yield g

    def serve(self, port: int) -> bool:
        """Serve /metrics on 127.0.0.1:port; False (and a warning) when the port is taken."""
        if not port:
            return False
        from prometheus_client import start_http_server

        try:
            start_http_server(port, addr="127.0.0.1", registry=self.registry)
        except OSError as exc:
            log.warning("metrics not served on 127.0.0.1:%s: %s", port, exc)
            return False
        return True
