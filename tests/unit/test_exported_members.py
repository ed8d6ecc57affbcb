import ctrlcomm


def test_all_is_pinned():
    assert sorted(ctrlcomm.__all__) == sorted([
        "AioGroup", "AsyncZMQCommunicator", "CodecError", "CollectiveTimeoutError", "ConcurrentUseError",
        "CtrlcommError", "FormationError", "FormationTimeoutError", "Group",
        "GroupBrokenError", "GroupClosedError", "InvalidArgumentError", "MismatchError",
        "MismatchTimeoutError",
        "OperandError", "PeerLostError", "ReductionError", "StatelessProcessGroup", "StoreClient",
        "StoreError", "StoreQueueEmptyError", "StoreServer", "StoreTimeoutError", "__version__",
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
