"""edgellm.units: one size convention for every option (GB = 10^9, GiB = 2^30) and one loopback check.

The size options are read through their own parsers (quant.budget.parse_budget, engine.gpu.parse_size,
cli.worker_cmds.parse_mem) and their --help through the real CLI; the worker is started for real.
"""

from __future__ import annotations

import re
import subprocess

import pytest
from support.helpers import assert_one_line_error, cli_argv
from test_rpc import Worker

from edgellm import units
from edgellm.cli.worker_cmds import parse_mem
from edgellm.engine.gpu import parse_size as parse_gpu_mem
from edgellm.errors import UsageError
from quant.budget import parse_budget


@pytest.mark.parametrize(
    "text, n",
    [
        ("2GB", 2 * 10**9),
        ("2G", 2 * 10**9),
        ("2gb", 2 * 10**9),
        ("2 GB", 2 * 10**9),
        ("2GiB", 2 * 2**30),
        ("95.5MiB", int(95.5 * 2**20)),
        ("100MB", 10**8),
        ("512KiB", 512 * 1024),
        ("1.5TB", 15 * 10**11),
        ("4096", 4096),
    ],
)
def test_one_convention(text, n):
    assert units.parse_size(text, option="--x") == n


@pytest.mark.parametrize("text", ["lots", "5iB", "-1GB", "2GBs", "1e9", "GB"])
def test_a_bad_size_is_one_line_naming_the_option_and_the_convention(text):
    with pytest.raises(UsageError) as e:
        units.parse_size(text, option="--mem")
    assert str(e.value) == f"--mem: {text!r} is not a size like 512MB, 2GB or 2GiB (GB = 10^9 bytes, GiB = 2^30)"


def test_budget_gpu_mem_and_worker_mem_read_2gb_as_the_same_bytes():
    budget = parse_budget("2GB", None).bytes
    assert budget == parse_gpu_mem("2GB") == parse_mem("2GB") == 2_000_000_000
    assert parse_budget("2GiB", None).bytes == parse_gpu_mem("2GiB") == parse_mem("2GiB") == 2 * 2**30


@pytest.mark.parametrize(
    "argv, option",
    [
        (["quantize", "--help"], "--budget"),
        (["chat", "--help"], "--gpu-mem"),
        (["bench", "--help"], "--gpu-mem"),
        (["worker", "--help"], "--mem"),
    ],
)
def test_each_size_options_help_says_which_convention(argv, option):
    out = subprocess.run(cli_argv(*argv), capture_output=True, text=True, timeout=60).stdout
    text = re.sub(r"\s+", " ", out)
    entry = text[text.index(option + " SIZE ") :][:400]  # the option's own entry, as click wraps it
    assert re.search(r"GB = 10\^9 bytes, GiB = 2\^30", entry), entry


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "127.0.0.2", "::1", "[::1]", "LOCALHOST"])
def test_loopback(host):
    assert units.is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "example.com", "10.0.0.1", ""])
def test_not_loopback(host):
    assert not units.is_loopback(host)


@pytest.mark.parametrize("host", ["::1", "localhost"])
def test_the_worker_starts_on_a_loopback_host_without_allow_network(host):
    w = Worker("--host", host)  # waits for "listening on 127.0.0.1:PORT" (llama.cpp's RPC server is IPv4 only)
    try:
        assert "offering" in w.banner
    finally:
        code, err = w.stop()
    assert code == 0 and "--allow-network" not in err and "no authentication" not in err, err


def test_the_worker_refuses_0000_without_allow_network(cli):
    res = cli("worker", "--host", "0.0.0.0")
    assert_one_line_error(res)
    assert res.exit_code == 2 and res.stderr.startswith("error: refusing to listen on 0.0.0.0 without --allow-network: ")


def test_the_worker_refuses_an_ipv6_address_llama_cpp_cannot_serve(cli):
    res = cli("worker", "--host", "fe80::1", "--allow-network")
    assert_one_line_error(res)
    assert res.exit_code == 2 and "IPv4 only" in res.stderr
