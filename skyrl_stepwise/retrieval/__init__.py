"""Retrieval for the Search-R1 recipe: indexes (BM25 / dense), an HTTP server, and an async client."""

from skyrl_stepwise.retrieval.client import (RetrievalClient, RetrievalClientConfig, RetrievalError,
                                            RetrieverEndpointConfig)
from skyrl_stepwise.retrieval.index import Document, Hit, load_or_build, read_corpus, split_contents

__all__ = ["Document", "Hit", "RetrievalClient", "RetrievalClientConfig", "RetrievalError", "RetrieverEndpointConfig",
           "load_or_build", "read_corpus", "split_contents"]
