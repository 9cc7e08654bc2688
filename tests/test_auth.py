"""API keys come from SPECSERVE_API_KEYS and the file cluster.yaml names, never from the YAML;
only 'Bearer <a known key>' passes once any key is configured."""

from __future__ import annotations

import pytest

from cluster.config import API_KEYS_ENV
from router.auth import ApiKeys
from router.errors import OpenAIError


def test_no_keys_anywhere_lets_every_request_through():
    keys = ApiKeys.load(None, environ={})
    assert not keys.required
    keys.check(None)
    keys.check("Bearer anything")


def test_keys_from_the_environment_and_the_file_both_count(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("sk-file  # a comment\n# sk-commented-out\n\n")
    keys = ApiKeys.load(keys_file, environ={API_KEYS_ENV: " sk-env-1 , ,sk-env-2"})
    assert keys.required
    for key in ("sk-file", "sk-env-1", "sk-env-2"):
        keys.check(f"Bearer {key}")
        keys.check(f"bearer {key}")                # the scheme is case-insensitive
    for header in (None, "", "Bearer", "Bearer sk-commented-out", "Bearer sk-env", "Token sk-file",
                   "sk-file", "Bearer  sk-file-and-more"):
        with pytest.raises(OpenAIError) as refused:
            keys.check(header)
        assert refused.value.status == 401 and refused.value.code == "invalid_api_key"
        assert refused.value.headers == {"WWW-Authenticate": "Bearer"}


def test_an_empty_environment_variable_requires_nothing():
    assert not ApiKeys.load(None, environ={API_KEYS_ENV: " , "}).required
