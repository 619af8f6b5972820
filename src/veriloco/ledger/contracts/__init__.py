"""The LineageLedger Vyper contract, its committed ABI and bytecode, and `compile.py`."""
