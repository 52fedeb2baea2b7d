"""One `pdserve serve` (float32, the embedded model) for the API tests of this folder."""

from __future__ import annotations

import openai
import pytest

from pdserve.model.loader import EMBEDDED_NAME
from tests.utils import start_server

MAX_MODEL_LEN = 512
ALIAS = "smol"  # a second --served-model-name


@pytest.fixture(scope="session")
def server():
    srv = start_server(["serve", "--dtype", "float32", "--num-kv-blocks", "256",
                        "--max-model-len", str(MAX_MODEL_LEN),
                        "--served-model-name", EMBEDDED_NAME, ALIAS])
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)
