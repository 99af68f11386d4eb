"""A clock the test moves by hand, in place of time.monotonic() or a component's injected clock."""


class FakeClock:
    def __init__(self, now_s: float = 0.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s
