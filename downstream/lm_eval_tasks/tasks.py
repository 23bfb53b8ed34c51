"""The datasets of the local lm-eval tasks beside this file, read from JSON lines (never downloaded)."""
import json
import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def read_jsonl(path, fix):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path} ({fix})")
    with open(path, encoding="utf-8") as f:
        return datasets.DatasetDict({"test": datasets.Dataset.from_list([json.loads(line) for line in f])})


def val_docs(val_docs="data/shakespeare/val_docs.jsonl", **metadata):
    """step_val: the documents that `python downstream/val_docs.py DATA_DIR` wrote."""
    return read_jsonl(val_docs, "write it with: python downstream/val_docs.py DATA_DIR, and pass "
                                "--metadata '{\"val_docs\": \"DATA_DIR/val_docs.jsonl\"}'")


def mc_questions(**metadata):
    """step_mc: the questions shipped beside this file."""
    return read_jsonl(os.path.join(HERE, "step_mc.jsonl"), "it ships with the repository")
