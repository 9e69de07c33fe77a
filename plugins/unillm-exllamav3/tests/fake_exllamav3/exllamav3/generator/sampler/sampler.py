class Sampler:
    def __init__(self) -> None:
        self.reqs_past_ids = False
        self.reqs_torch_seed = False
