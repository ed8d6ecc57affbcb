import ctrlcomm


def test_all_is_pinned():
    assert sorted(ctrlcomm.__all__) == sorted([
        "AioGroup", "AsyncZMQCommunicator", "CodecError", "CollectiveTimeoutError", "ConcurrentUseError",
        "CtrlcommError", "FormationError", "FormationTimeoutError", "Group",
        "GroupBrokenError", "GroupClosedError", "InvalidArgumentError", "MismatchError",
        "MismatchTimeoutError",
        "OperandError", "PeerLostError", "ReductionError", "StatelessProcessGroup", "StoreClient",
        "StoreError", "StoreLimits", "StoreQueueEmptyError", "StoreServer", "StoreTimeoutError", "__version__",
        "dump_flight_records", "dump_flight_records_on",
    ])
    for name in ctrlcomm.__all__:
        assert hasattr(ctrlcomm, name)


def test_every_error_derives_from_one_base():
    for name in ctrlcomm.__all__:
        obj = getattr(ctrlcomm, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, ctrlcomm.CtrlcommError)
    assert issubclass(ctrlcomm.CollectiveTimeoutError, TimeoutError)
    assert issubclass(ctrlcomm.InvalidArgumentError, ValueError)
    # as torch.distributed's errors: code written for vLLM's barrier catches RuntimeError
    assert issubclass(ctrlcomm.CtrlcommError, RuntimeError)
    # a rank's operand the op cannot reduce: a failed reduction, and a bad argument
    assert issubclass(ctrlcomm.OperandError, ctrlcomm.ReductionError)
    assert issubclass(ctrlcomm.OperandError, ctrlcomm.InvalidArgumentError)
    # a timeout whose cause, the peers answered, is a mismatch: both
    assert issubclass(ctrlcomm.MismatchTimeoutError, ctrlcomm.MismatchError)
    assert issubclass(ctrlcomm.MismatchTimeoutError, ctrlcomm.CollectiveTimeoutError)


def test_the_integration_modules_are_pinned():
    import ctrlcomm.vllm

    assert sorted(ctrlcomm.vllm.__all__) == ["install", "installed"]


def test_install_without_vllm_changes_nothing():
    """Where vLLM is not installed (made unimportable here, in a process of its own),
    install() says so and ctrlcomm's class is as it was."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['vllm'] = None\n"
            "import ctrlcomm, ctrlcomm.vllm\n"
            "assert ctrlcomm.vllm.install() is False and ctrlcomm.vllm.installed() is None\n"
            "assert not any(type(f).__name__ == '_Finder' for f in sys.meta_path)\n"
            "pg = ctrlcomm.StatelessProcessGroup(rank=0, world_size=2)\n"
            "assert type(pg) is ctrlcomm.StatelessProcessGroup\n"
            "print('unchanged')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "unchanged", p.stderr
