"""Where a node agent's reports go: its principal's own channel, `gpupool.node.NAME` (docs/security.md, "Node
identity"). The worker relays each report from there to its home topic once it checked that it is about a node the
principal speaks for; a node agent writes nowhere else.

`NodeChannels` is one producer per principal behind the `send(topic, key=, value=)` / `flush()` an agent's producer
has, so a simulated fleet of many nodes, each with its own principal, writes through one object. `fleet_credentials`
finds the credentials of a fleet's nodes under $GPUPOOL_HOME (made by `gpupool up`, by the test stacks, or by
`gpupool user add NAME --role node --node NODE`), making them first when the configured user is an operator of a
local stack and they are missing (`ensure_fleet`).
"""
from __future__ import annotations

import asyncio

from infra import security
from infra.config import Config
from schemas.topics import node_channel


def speaking_for(cfg: Config, nodes: list[str], principal: str | None = None) -> dict[str, security.Credentials]:
    """node -> the credentials of the principal that speaks for it: `principal` for every node when named, else
    the stored node principal registered for each (one a node, or one for the whole fleet). A node nobody speaks
    for raises CredentialsError naming it."""
    if principal:
        creds = security.load(cfg, principal)
        return {n: creds for n in nodes}
    by_node: dict[str, security.Credentials] = {}
    for creds in security.stored_all(cfg.home):
        if creds.role == "node":
            for n in creds.nodes:
                by_node.setdefault(n, creds)
    missing = [n for n in nodes if n not in by_node]
    if missing:
        raise security.CredentialsError(
            f"no node principal for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} under "
            f"{security.credentials_dir(cfg.home)}: `gpupool user add NAME --role node --node NODE` (an operator)")
    return {n: by_node[n] for n in nodes}


def ensure_fleet(cfg: Config, nodes: list[str]) -> None:
    """The simulated fleet's node principals (infra/principals.add_fleet), made with the configured user's
    credentials when some are missing: what `gpupool up` does before it starts the fleet."""
    try:
        speaking_for(cfg, nodes)
        return
    except security.CredentialsError:
        pass
    from infra import principals

    asyncio.run(principals.add_fleet(cfg, security.kafka_conn(cfg), nodes))


class NodeChannels:
    """One idempotent producer per principal; `send(topic, ...)` goes through the producer of the channel's owner."""

    def __init__(self, cfg: Config, by_node: dict[str, security.Credentials], **producer_options):
        self.cfg = cfg
        self.by_node = by_node
        self.topic_of = {n: node_channel(c.name).name for n, c in by_node.items()}
        self.options = producer_options
        self.producers: dict[str, object] = {}

    async def start(self) -> None:
        from aiokafka import AIOKafkaProducer

        for creds in {c.name: c for c in self.by_node.values()}.values():
            opts = security.kafka_conn(self.cfg, creds.name).options()
            producer = AIOKafkaProducer(**opts, acks="all", enable_idempotence=True, **self.options)
            await producer.start()
            self.producers[node_channel(creds.name).name] = producer

    async def send(self, topic: str, key: bytes | None = None, value: bytes | None = None):
        return await self.producers[topic].send(topic, key=key, value=value)

    async def flush(self) -> None:
        await asyncio.gather(*(p.flush() for p in self.producers.values()))

    async def stop(self) -> None:
        await asyncio.gather(*(p.stop() for p in self.producers.values()), return_exceptions=True)
