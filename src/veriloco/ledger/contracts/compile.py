"""Compile `LineageLedger.vy` with vyper and write the ABI and deploy bytecode beside it.

    python -m veriloco.ledger.contracts.compile           # regenerate the two files
    python -m veriloco.ledger.contracts.compile --check   # exit 1 if the committed files differ

The compiled files are committed so that using `EvmLedger` needs web3 but not vyper; the test
suite recompiles and asserts the committed bytecode is what this source and compiler produce.
`EVM_VERSION` is cancun: eth-tester's py-evm backend runs Prague (a superset), and cancun is
also what most public EVM chains and dev nodes accept today.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "LineageLedger.vy"
ABI_FILE = HERE / "LineageLedger.abi.json"
BIN_FILE = HERE / "LineageLedger.bin"
VYPER_VERSION = "0.4.3"
EVM_VERSION = "cancun"


def compile_contract() -> tuple[list[dict], str]:
    """Compile the Vyper source; return (abi, deploy bytecode as 0x-hex)."""
    import vyper
    from vyper.compiler import compile_code
    from vyper.compiler.settings import Settings

    if vyper.__version__.split("+")[0] != VYPER_VERSION:
        raise RuntimeError(
            f"vyper {vyper.__version__} installed, the committed bytecode is from {VYPER_VERSION}"
        )
    out = compile_code(
        SOURCE.read_text(),
        contract_path=SOURCE.name,
        output_formats=["abi", "bytecode"],
        settings=Settings(evm_version=EVM_VERSION),
    )
    return out["abi"], out["bytecode"]


def render(abi: list[dict], bytecode: str) -> tuple[str, str]:
    """The exact text of the two committed files."""
    return json.dumps(abi, indent=2, sort_keys=True) + "\n", bytecode + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write (or with --check, compare) the compiled ABI and bytecode files."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    args = p.parse_args(argv)
    abi_text, bin_text = render(*compile_contract())
    if args.check:
        stale = [
            f.name for f, text in ((ABI_FILE, abi_text), (BIN_FILE, bin_text))
            if not f.exists() or f.read_text() != text
        ]
        if stale:
            print(f"stale compiled contract files: {', '.join(stale)}", file=sys.stderr)
            return 1
        return 0
    ABI_FILE.write_text(abi_text)
    BIN_FILE.write_text(bin_text)
    print(f"wrote {ABI_FILE.name} and {BIN_FILE.name} (evm {EVM_VERSION}, vyper {VYPER_VERSION})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
