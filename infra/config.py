"""Configuration from the environment; every process reads the same three variables."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Config:
    home: Path
    kafka: str | None  # bootstrap servers; None: the project runs its own local broker
    clickhouse: str
    kafka_port: int
    web_port: int

    @property
    def bootstrap(self) -> str:
        return self.kafka or f"127.0.0.1:{self.kafka_port}"


def load() -> Config:
    home = Path(os.environ.get("GPUPOOL_HOME", "./.gpupool")).resolve()
    return Config(
        home=home,
        kafka=os.environ.get("GPUPOOL_KAFKA") or None,
        clickhouse=os.environ.get("GPUPOOL_CLICKHOUSE") or f"chdb://{home / 'clickhouse'}",
        kafka_port=int(os.environ.get("GPUPOOL_KAFKA_PORT", "19092")),
        web_port=int(os.environ.get("GPUPOOL_WEB_PORT", "16066")),
    )
