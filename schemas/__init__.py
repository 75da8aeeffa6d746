"""Contracts only: events, envelope, codec, topics, upcasters. Imports nothing from the rest of gpupool."""
from schemas.envelope import SCHEMA_VERSION, DecodeError, Envelope, decode, encode, envelope  # noqa: F401
from schemas.events import *  # noqa: F401,F403
