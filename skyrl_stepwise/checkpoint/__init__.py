"""Persistence: saving and loading checkpoints (`store`), verifying them before a resume (`verify`), the driver's
own state, and the fingerprint that says a resumed run reads the same data."""
