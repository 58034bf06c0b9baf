"""oar.pipeline_cache: one cached Pipeline per (scope, config, tokenizer, extra kwargs)."""

import pytest

import oar
from oar import pipeline_cache
from oar.pipeline import Pipeline


class _Tok:  # the attributes pipeline_cache reads of a tokenizer (no Pipeline is built with it here)
    name_or_path = "tiny"

    def __len__(self):
        return 10


def test_same_key_same_pipeline_and_clear():
    cfg = oar.OARConfig(method="grpo")
    a = pipeline_cache.pipeline_for(cfg)
    assert isinstance(a, Pipeline) and pipeline_cache.pipeline_for(oar.OARConfig(method="grpo")) is a
    assert pipeline_cache.pipeline_for(oar.OARConfig(method="dr_grpo")) is not a
    b = pipeline_cache.pipeline_for(cfg, ignore_ids=(1, 2))
    assert b is not a and b.ignore_ids == (1, 2) and pipeline_cache.pipeline_for(cfg, ignore_ids=(1, 2)) is b
    pipeline_cache.clear()
    assert pipeline_cache.pipeline_for(cfg) is not a


def test_scopes():
    cfg = oar.OARConfig(method="grpo")

    class Owner:
        pass

    o1, o2 = Owner(), Owner()
    p1 = pipeline_cache.pipeline_for(cfg, scope=o1)
    assert pipeline_cache.pipeline_for(cfg, scope=o1) is p1 and pipeline_cache.pipeline_for(cfg, scope=o2) is not p1
    n = pipeline_cache.pipeline_for(cfg, scope="test-scope")
    assert pipeline_cache.pipeline_for(cfg, scope="test-scope") is n
    pipeline_cache.clear("test-scope")
    assert pipeline_cache.pipeline_for(cfg, scope="test-scope") is not n
    assert pipeline_cache.tokenizer_identity(_Tok()) == ("tiny", 10, "_Tok")
    assert pipeline_cache.tokenizer_identity(None) is None


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"^config must be an oar.OARConfig or None, got dict"):
        pipeline_cache.pipeline_for({"method": "grpo"})
    with pytest.raises(ValueError, match=r"^pipeline_for keyword 'ignore_ids' must be hashable .*, got list$"):
        pipeline_cache.pipeline_for(None, ignore_ids=[1])
    with pytest.raises(ValueError, match=r"^scope must be None, a str or a weakly referenceable object, got int$"):
        pipeline_cache.pipeline_for(None, scope=3)
