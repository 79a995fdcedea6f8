#!/usr/bin/env bash
# Build the copy of the working tree that a device call runs (default DEST: .gpusuite, which the device tool's
# `carry` sends along): every tracked and every untracked, not ignored file as it is now (so a new file need
# not be committed or `git add`-ed first; `git stash create` + `git archive` leaves untracked files out), less
# benchmarks/results (large, not needed there) and the default model (a symlink to the main tree's, which the
# device copy already has). DEST/COMMIT names the tree: HEAD, with "+dirty" when it differs from HEAD;
# `provenance.py` reads it on the device, where the git metadata is stale.
# Usage (in the repository root): bash benchmarks/gpusuite_tree.sh [DEST]   (DEST a folder directly in the root:
# the default-model symlink is relative to it)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.gpusuite}
rm -rf "$dest" && mkdir -p "$dest"
git ls-files -z --cached --others --exclude-standard \
    | grep -zv -e '^benchmarks/results/' -e '^longflash/default_model/' \
    | xargs -0 -I{} sh -c 'test -e "{}" && printf "%s\0" "{}"' \
    | tar --null -T - -cf - | tar -xf - -C "$dest"
ln -s ../../longflash/default_model "$dest/longflash/default_model"
commit=$(git rev-parse HEAD)
if [ -n "$(git status --porcelain --untracked-files=normal)" ]; then commit="$commit+dirty"; fi
echo "$commit" > "$dest/COMMIT"
echo "$dest: $(find "$dest" -type f | wc -l) files, $(du -sh "$dest" | cut -f1), COMMIT $commit"
