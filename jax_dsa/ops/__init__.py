"""The public DSA ops: implementation choice, validation and custom VJPs live here."""
