"""NNI 2.x's Retiarii transformer example (a language model whose encoder depth and dropout are
``ValueChoice``s, trained by the user's own loop, perplexity minimized) as a real subprocess."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from tridens.trial import TrialStatus

from .test_nni_oneshot import HERE, _script, _trials


def test_nni2_transformer_example_searches_depth_and_dropout_and_exports_the_lowest_perplexity(tmp_path: Path) -> None:
    stdout, db = _script("transformer_nni2.py", "run", tmp_path)
    trials = _trials(db)
    assert len(trials) == 3 and all(t.status is TrialStatus.COMPLETED for t in trials)
    sys.path.insert(0, str(HERE))
    try:
        import transformer_nni2 as example
    finally:
        sys.path.remove(str(HERE))
    tokenize = example.get_tokenizer("basic_english")
    n_token = len(example.build_vocab_from_iterator(map(tokenize, example.WikiText2(split="train")), specials=["<unk>"]))
    for trial in trials:
        assert set(trial.sample) == {"p_dropout", "n_layer"} and trial.sample["n_layer"] in range(5, 10)
        assert 1.0 < trial.metric < n_token / 2  # far better than guessing among the vocabulary's words
    exported = ast.literal_eval(stdout.split("Final model:\n", 1)[1].strip().splitlines()[0])
    lowest = min(trials, key=lambda t: (t.metric, t.id))
    assert exported == lowest.sample  # optimize_mode='minimize': the lowest perplexity first
    assert re.search(r"trial \d+ completed value=\d+\.\d+", stdout)
