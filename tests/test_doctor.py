"""`meshwise doctor`: passes here; a small /dev/shm, a wrong interface name and friends come with the fix."""

import functools
import json

from meshwise.cli import main
from meshwise.doctor import network, software, system

MIB = 2**20


def _doctor(capsys, *args):
    code = main(["doctor", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_this_machine_passes(capsys):
    code, report = _doctor(capsys, "-np", "2")
    failures = [c for c in report["checks"] if c["status"] == "fail"]
    assert (code, report["ok"], failures) == (0, True, [])
    names = {c["name"] for c in report["checks"]}
    assert {"/dev/shm", "open files", "loopback", "devices", "MPI", "versions"} <= names
    assert all(c["status"] in ("pass", "warn") and c["detail"] for c in report["checks"])


def test_a_small_dev_shm_fails_with_the_fix(capsys, monkeypatch):
    small = functools.partial(system.check_shm, free=MIB // 4, total=64 * MIB)  # a full /dev/shm
    monkeypatch.setattr(system, "check_shm", small)
    code, report = _doctor(capsys, "-np", "4")
    shm = next(c for c in report["checks"] if c["name"] == "/dev/shm")
    assert code == 1 and not report["ok"]
    assert shm["status"] == "fail" and "64 MiB" in shm["detail"]
    assert "--shm-size=" in shm["fix"] and "gloo" in shm["fix"]


def test_dev_shm_that_fits_the_transport_but_not_data_loaders_warns():
    (found,) = system.check_shm(2, free=60 * MIB, total=64 * MIB)
    assert found.status == "warn" and "bus error" in found.detail and "--shm-size" in found.fix
    (shrunk,) = system.check_shm(8, free=40 * MIB, total=64 * MIB)
    assert shrunk.status == "warn" and "shrink" in shrunk.detail


def test_a_wrong_interface_name_fails_with_the_names_present(capsys, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nonexistent0")
    code, report = _doctor(capsys, "-np", "2")
    gloo = next(c for c in report["checks"] if c["name"] == "GLOO_SOCKET_IFNAME")
    assert code == 1 and gloo["status"] == "fail" and "nonexistent0" in gloo["detail"]
    assert "lo" in gloo["fix"] and gloo["fix"].startswith("export GLOO_SOCKET_IFNAME=")


def test_nccl_interface_specs_follow_nccl_rules():
    names = ["lo", "docker0", "eth0", "eth1", "ib0"]
    assert network.nccl_matches("eth", names) == ["eth0", "eth1"]
    assert network.nccl_matches("=eth0", names) == ["eth0"]
    assert network.nccl_matches("^lo,docker", names) == ["eth0", "eth1", "ib0"]
    (bad,) = network.check_interfaces({"NCCL_SOCKET_IFNAME": "enp"}, names)
    assert bad.status == "fail" and "selects none" in bad.detail


def test_devices_limits_and_nccl_variables():
    (gpus,) = software.check_devices(4, {}, visible=2)
    assert gpus.status == "fail" and "-np 2" in gpus.fix
    (memlock,) = system.check_locked_memory(limit=8 * MIB, rdma=True)
    assert memlock.status == "fail" and "memlock" in memlock.fix
    (files,) = system.check_open_files(8, limit=1024)
    assert files.status == "warn" and "ulimit -n 8192" in files.fix
    disabled = software.check_nccl_env({"NCCL_IB_DISABLE": "1", "NCCL_ALGO": "ring", "NCCL_SHM_DISABLE": "0"})
    assert [c.name for c in disabled] == ["NCCL_IB_DISABLE", "NCCL_ALGO"]
    (addr,) = network.check_master_addr({"MASTER_ADDR": "no-such-host.invalid"})
    assert addr.status == "fail"


def test_a_probe_that_breaks_is_a_finding_not_a_crash(capsys, monkeypatch):
    def broken(ranks):
        raise OSError("no /proc here")

    monkeypatch.setattr(system, "check_cores", broken)
    code, report = _doctor(capsys, "-np", "2")
    cores = next(c for c in report["checks"] if c["name"] == "cores")
    assert code == 0 and cores["status"] == "warn" and "no /proc here" in cores["detail"]
