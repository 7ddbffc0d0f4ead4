"""The NUMA topology from sysfs (ellm/numa/topology.py), on fake trees of many shapes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ellm.errors import EllmError
from ellm.numa.topology import default_threads, parse_cpu_list, read_topology
from fake_sysfs import make_sysfs

SHAPES = [  # (cores per node, SMT, memory GiB per node)
    ([2], 1, [24]),
    ([8, 8], 1, [64, 64]),
    ([8, 8], 2, [64, 64]),
    ([4, 4, 4, 4], 2, [32, 32, 32, 32]),
    ([6] * 8, 2, [48] * 8),
    ([12, 4], 2, [96, 16]),  # asymmetric
]


@pytest.mark.parametrize("cores,smt,mem", SHAPES)
def test_topology_of_fake_trees(tmp_path, cores, smt, mem):
    topo = read_topology(make_sysfs(tmp_path, cores, smt, mem))
    assert [n.physical_cores for n in topo.nodes] == cores
    assert [len(n.cpus) for n in topo.nodes] == [k * smt for k in cores]
    assert [n.memory_bytes for n in topo.nodes] == [int(g * 2**30) for g in mem]
    assert topo.smt == (smt > 1)
    all_cpus = [c for n in topo.nodes for c in n.cpus]
    assert len(all_cpus) == len(set(all_cpus)) == sum(cores) * smt
    for n in topo.nodes:  # each core's siblings are on its node
        assert sorted(c for core in n.cores for c in core) == list(n.cpus)
        assert all(topo.node_of_cpu(c) == n.id for c in n.cpus)
    assert topo.distances[0][0] == 10 and all(len(r) == len(cores) for r in topo.distances)
    # the default thread count: physical cores, not logical CPUs
    assert default_threads(topo, set(all_cpus)) == sum(cores)
    assert default_threads(topo, set(topo.nodes[0].cpus)) == cores[0]
    d = topo.to_dict()
    assert set(d) == {"nodes", "distances"}
    assert {"id", "cpus", "physical_cores", "memory_bytes"} <= set(d["nodes"][0])


def test_asymmetric_distances_are_kept(tmp_path):
    dist = [[10, 16, 32], [16, 10, 32], [32, 32, 10]]
    topo = read_topology(make_sysfs(tmp_path, [4, 4, 2], 1, [8, 8, 4], dist))
    assert [list(r) for r in topo.distances] == dist


def test_siblings_only_count_once(tmp_path):
    topo = read_topology(make_sysfs(tmp_path, [4], smt=2))
    # CPUs 0 and 4 are one core: allowing both is one thread's worth
    assert default_threads(topo, {0, 4}) == 1
    assert default_threads(topo, {0, 1, 4, 5}) == 2


def test_no_node_directory_is_one_node(tmp_path):
    (tmp_path / "devices/system/cpu").mkdir(parents=True)
    (tmp_path / "devices/system/cpu/online").write_text("0-5\n")
    topo = read_topology(tmp_path)
    assert len(topo.nodes) == 1 and topo.nodes[0].cpus == tuple(range(6))


def test_cpu_lists():
    assert parse_cpu_list("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpu_list("") == ()
    for bad in ("a-b", "3-1"):
        with pytest.raises(EllmError):
            parse_cpu_list(bad)


def test_targets_prints_the_topology(tmp_path):
    import os

    make_sysfs(tmp_path, [4, 4], smt=2, memory_gib=[32, 16])
    env = {**os.environ, "ELLM_SYSFS_ROOT": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "ellm", "targets", "--json"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    numa = json.loads(out.stdout)["numa"]
    assert [n["physical_cores"] for n in numa["nodes"]] == [4, 4]
    assert numa["nodes"][1]["memory_bytes"] == 16 * 2**30 and numa["distances"] == [[10, 21], [21, 10]]
    text = subprocess.run([sys.executable, "-m", "ellm", "targets"], capture_output=True, text=True, env=env).stdout
    assert "NUMA: 2 nodes, SMT" in text and "node 1: 4 cores, 8 CPUs" in text
