"""Prompt datasets: our parquet format, the Search-R1 converter, and the embedded offline dataset."""

from skyrl_stepwise.data.dataset import (PromptRow, convert_search_r1_file, load_prompt_dataset, search_r1_prompt,
                                         write_parquet)
from skyrl_stepwise.data.embedded import EmbeddedDataset, build_embedded_search_r1

__all__ = ["EmbeddedDataset", "PromptRow", "build_embedded_search_r1", "convert_search_r1_file",
           "load_prompt_dataset", "search_r1_prompt", "write_parquet"]
