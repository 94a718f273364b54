"""The one reader of nvidia-smi's CSV (runtime/nvsmi.py), for the daemon's
watch and the controller's probe alike."""

from __future__ import annotations

import pytest

from eltctl_runtime import nvsmi
from eltctl_runtime.nvsmi import GpuApp, GpuInfo, parse_app_line, parse_apps, parse_gpu_line, parse_gpus, parse_number

WATCH = ("index", "uuid", "memory.used", "memory.total", "utilization.gpu")  # the daemon's query: no name


@pytest.mark.parametrize("text, value", [
    ("40960", 40960), (" 3 ", 3), ("12 MiB", 12), ("7 %", 7), ("7%", 7), ("12.6", 13),
    ("[N/A]", None), ("[Not Supported]", None), ("N/A", None), ("[Unknown Error]", None), ("", None), ("x", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("line, expected", [
    ("0, GPU-1, NVIDIA A100-SXM4-40GB, 3, 40960, 0", GpuInfo(0, "GPU-1", 3, 40960, 0, "NVIDIA A100-SXM4-40GB")),
    ("1, GPU-2, NVIDIA A100-SXM4-40GB, 3, 40960, [N/A]", GpuInfo(1, "GPU-2", 3, 40960, None, "NVIDIA A100-SXM4-40GB")),
    ("2, GPU-3, Tesla, weird, name, [Not Supported], [Not Supported], [Not Supported]",
     GpuInfo(2, "GPU-3", None, None, None, "Tesla, weird, name")),
    ("No devices were found", None),
    ("0, GPU-1, too short", None),
    ("x, GPU-1, A, 1, 2, 3", None),
])
def test_gpu_line_with_its_name(line, expected):
    assert parse_gpu_line(line) == expected


@pytest.mark.parametrize("line, expected", [
    ("0, GPU-a, 600, 40960, 3", GpuInfo(0, "GPU-a", 600, 40960, 3)),
    ("0, GPU-a, 12 MiB, 81920 MiB, 7 %", GpuInfo(0, "GPU-a", 12, 81920, 7)),
    ("0, GPU-a, 1, 2", None),
])
def test_gpu_line_of_a_query_without_the_name(line, expected):
    assert parse_gpu_line(line, WATCH) == expected


@pytest.mark.parametrize("line, expected", [
    ("GPU-1, 4242, 2000, python", GpuApp("GPU-1", 4242, 2000, "python")),
    ("GPU-1, 4242, [N/A], /usr/bin/python3", GpuApp("GPU-1", 4242, None, "/usr/bin/python3")),
    ("GPU-a, 1234, [N/A], /opt/my app, v2", GpuApp("GPU-a", 1234, None, "/opt/my app, v2")),
    ("GPU-a, 9, 5", GpuApp("GPU-a", 9, 5, "")),  # no process name at all
    ("GPU-1, [N/A], 10, x", None),
    ("GPU-b, 7", None),
    ("garbage", None),
])
def test_app_line(line, expected):
    assert parse_app_line(line) == expected


def test_whole_answers_skip_what_does_not_fit():
    assert parse_gpus("garbage\nx, GPU-a, 1, 2, 3\n\n2, GPU-c, 1, 2, 3\n", WATCH) == (GpuInfo(2, "GPU-c", 1, 2, 3),)
    assert parse_apps("GPU-a, 1, 2, p\nshort\n") == (GpuApp("GPU-a", 1, 2, "p"),)
    assert parse_gpus("") == () and parse_apps("") == ()


def test_query_arguments():
    assert nvsmi.query_gpus() == ["--query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu",
                                  "--format=csv,noheader,nounits"]
    assert nvsmi.query_apps() == ["--query-compute-apps=gpu_uuid,pid,used_memory,process_name",
                                  "--format=csv,noheader,nounits"]
    assert nvsmi.query_gpus(WATCH)[0] == "--query-gpu=index,uuid,memory.used,memory.total,utilization.gpu"
