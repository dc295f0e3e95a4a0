#!/usr/bin/env bash
# A real English corpus of over 50 MB that installs offline from Debian's package archive, for benchmarks that must
# not repeat their data within a run (the parity benchmark): the documentation sources of three projects, one
# document per file, written by people for people (prose with some code):
#   linux-doc-6.1   the Linux kernel's Documentation/, reStructuredText, ~24 MB, GPL-2.0
#   python3.11-doc  Python 3.11's documentation sources (_sources/*.rst.txt), ~11 MB, PSF License 2.0
#   perl-doc        Perl 5.36's manual pages in POD, ~9 MB, Artistic License or GPL-1+
#   git-doc         Git's manual pages and guides (AsciiDoc text), ~3 MB, GPL-2.0
#   debian-reference-en  the Debian Reference, ~0.9 MB, GPL-2+
#   fortunes        fortune-mod's quotations, ~2.5 MB, BSD-4-Clause and public domain (see its copyright file)
# The packages are downloaded and unpacked here (apt-get download, dpkg -x), not installed.
#   bash scripts/setup/corpus.sh [OUT]          (default runs/corpora/docs-en; prints its size)
# Then: p2pdiloco data prepare OUT --tokenizer TOKENIZER --out DATASET
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/corpora/docs-en}
if [ -d "$OUT" ] && [ -n "$(ls -A "$OUT")" ]; then
  echo "$OUT: $(du -sb "$OUT" | cut -f1) bytes (already there)"; exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
packages=(linux-doc-6.1 python3.11-doc perl-doc git-doc debian-reference-en fortunes)
(cd "$work" && apt-get download -q "${packages[@]}" >/dev/null 2>&1) || {
  [ "$(id -u)" = 0 ] && apt-get update -q >/dev/null && (cd "$work" && apt-get download -q "${packages[@]}" >/dev/null)
} || { echo "could not download ${packages[*]} from Debian's archive" >&2; exit 1; }
for deb in "$work"/*.deb; do dpkg -x "$deb" "$work/root"; done
mkdir -p "$OUT"/{kernel,python,perl,git,debian,fortunes}
# each source file a .txt of its own (gz ones unpacked), its path flattened into its name
collect() {  # FOLDER PATTERN DEST [EXCLUDED PATTERN ...]
  local folder=$1 pattern=$2 dest=$3; shift 3
  local not=(); for x in "$@"; do not+=(! -name "$x"); done
  (cd "$folder" && find . -type f -name "$pattern" "${not[@]}" -print0) | while IFS= read -r -d '' f; do
    name=$(echo "${f#./}" | tr '/' '_'); name=${name%.gz}
    if [[ $f == *.gz ]]; then zcat "$folder/$f" > "$dest/$name.txt"; else cp "$folder/$f" "$dest/$name.txt"; fi
  done
}
collect "$work/root/usr/share/doc/linux-doc-6.1/Documentation" '*.rst*' "$OUT/kernel"
collect "$(find "$work/root/usr/share/doc" -type d -path "*python3.11*" -name _sources | head -1)" '*.txt' "$OUT/python"
collect "$(find "$work/root/usr/share/perl" -type d -name pod | head -1)" '*.pod' "$OUT/perl"
collect "$work/root/usr/share/doc/git-doc" '*.txt' "$OUT/git"
collect "$work/root/usr/share/debian-reference" '*.en.txt.gz' "$OUT/debian"
collect "$work/root/usr/share/games/fortunes" '*' "$OUT/fortunes" '*.dat' '*.u8'  # .dat: indexes
echo "$OUT: $(du -sb "$OUT" | cut -f1) bytes in $(find "$OUT" -type f | wc -l) documents"
