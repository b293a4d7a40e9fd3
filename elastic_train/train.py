"""``python -m elastic_train.train`` / ``torchrun ... -m elastic_train.train``: the built-in
job's worker entrypoint, kept at this public name; the code is worker/train.py."""

if __name__ == "__main__":
    from elastic_train.worker.train import run_as_main

    run_as_main()
