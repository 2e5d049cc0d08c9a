"""`tandem keys ...`: CURVE key pairs for the edge–cloud links (common/security.py).

    tandem keys create verifier suffix dispatcher [--dir keys] [--allow NAME...] [--if-missing]
    tandem keys allow keys/dispatcher.key --allow-dir keys/allowed
    tandem keys show keys/verifier.key

A typical cloud/edge pair:

    tandem keys create verifier dispatcher --dir keys --allow dispatcher
    tandem serve verifier --curve-secret-key keys/verifier.key_secret --curve-allow-dir keys/allowed
    tandem serve dispatcher --curve-client-key keys/dispatcher.key_secret \\
        --curve-server-keys verifier=keys/verifier.key

Copy only NAME.key (public) between machines; NAME.key_secret stays where it is used.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import security


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem keys", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="action", required=True)
    c = sub.add_parser("create", help="write NAME.key and NAME.key_secret for each NAME")
    c.add_argument("names", nargs="+")
    c.add_argument("--dir", default="keys", help="where the key files go (default ./keys)")
    c.add_argument("--allow", nargs="*", default=[], metavar="NAME",
                   help="also copy these names' public keys into the allowlist directory")
    c.add_argument("--allow-dir", default=None,
                   help="allowlist directory for --allow (default DIR/allowed)")
    c.add_argument("--force", action="store_true", help="replace existing key pairs")
    c.add_argument("--if-missing", action="store_true",
                   help="keep key pairs that exist, create the others (a one-shot keys job "
                        "that may run again: compose's `keys`, the Kubernetes keys Job)")
    a = sub.add_parser("allow", help="add public key files to an allowlist directory")
    a.add_argument("public_keys", nargs="+")
    a.add_argument("--allow-dir", required=True)
    s = sub.add_parser("show", help="print the z85 public key of key files")
    s.add_argument("files", nargs="+")
    args = ap.parse_args(argv)
    try:
        if args.action == "create":
            unknown = set(args.allow) - set(args.names)
            if unknown:
                ap.error(f"--allow names keys not being created: {sorted(unknown)}")
            allow_dir = args.allow_dir or f"{args.dir}/allowed"
            for name in args.names:
                existing = Path(args.dir) / f"{name}.key_secret"
                if args.if_missing and not args.force and existing.exists():
                    public = existing.with_suffix(".key")
                    print(f"{name}: {public} exists, kept")
                else:
                    public, secret = security.create_keys(args.dir, name, force=args.force)
                    print(f"{name}: {public} (public), {secret} (secret)")
                if name in args.allow:
                    print(f"  allowed: {security.allow(public, allow_dir)}")
        elif args.action == "allow":
            for path in args.public_keys:
                print(f"allowed: {security.allow(path, args.allow_dir)}")
        else:
            for path in args.files:
                print(f"{path}: {security.public_key_z85(path)}")
    except security.KeyFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
