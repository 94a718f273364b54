"""Fixtures of the runtime tests: `cluster_factory` / `cluster` (see runtime_cluster.py)."""

from __future__ import annotations

import pytest

from runtime_cluster import Cluster


@pytest.fixture
def cluster_factory(tmp_path):
    made: list[Cluster] = []

    def make(**kw) -> Cluster:
        c = Cluster(tmp_path / f"c{len(made)}", **kw)
        c.tmp.mkdir(parents=True)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def cluster(cluster_factory) -> Cluster:
    return cluster_factory()


