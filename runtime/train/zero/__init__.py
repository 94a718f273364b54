"""Sharded optimizer state (ZeRO-1 and ZeRO-2) whose shards move live between
members (docs/sharding.md)."""
