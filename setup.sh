#!/usr/bin/env bash
# One command for a newcomer: installs what the engine needs (Rust dependencies, libtorch from
# the PyTorch 2.13.0 wheel in .venv), builds `edgemoe`, converts the demo checkpoint into the
# default bundle (bundles/switch-samsum-tiny) and summarizes a sample dialogue with it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

./deploy/dev-env.sh
cargo build --release
./target/release/edgemoe convert --hf models/switch-samsum-tiny --out bundles/switch-samsum-tiny
echo
echo "Dialogue (models/sample-dialogue.txt):"
sed 's/^/  /' models/sample-dialogue.txt
echo
echo "Summary:"
./target/release/edgemoe summarize --input models/sample-dialogue.txt --budget 1.5GiB
