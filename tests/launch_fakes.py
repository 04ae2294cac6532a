"""Stand-ins for a Triton/Gluon kernel and the driver, shared by the CPU
tests of the cached fast launches (``plan.launch_forward``,
``plan_backward.launch_backward``, ``plan.launch_triton``). Each launch is
appended to a log: ``("jit", grid, args, kwargs)`` for the public
``kernel[grid](...)`` launch, ``("fast", args)`` for the compiled kernel's
``run``."""


class FakeCompiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, object(), object()

    def run(self, *args):
        self.log.append(("fast", args))


class FakeJIT:
    """``real``: the kernel it replaces, for its parameter names."""

    def __init__(self, log, real=None):
        self.log, self.real = log, real

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return FakeCompiled(self.log)
        return launch


class FakeDriver:
    """``driver`` with the current stream as 7."""

    class active:
        @staticmethod
        def get_current_stream(device):
            return 7
