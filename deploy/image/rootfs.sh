#!/usr/bin/env bash
# The images' base root filesystem, from Debian's packages with mmdebstrap
# (no registry): $WORK/base-$SUITE.tar. The installed package versions are
# compared with packages-$SUITE.txt, the list recorded in the repository;
# RECORD=1 rewrites that list, STRICT=1 fails on any difference.
set -euo pipefail
# shellcheck source=common.sh
. "$(dirname "$0")/common.sh"
need mmdebstrap

mkdir -p "$WORK"
out=$WORK/base-$SUITE.tar
list=$HERE/packages-$SUITE.txt
# The tarball is reused while what it was made from is unchanged.
want="$SUITE $MIRROR $SECURITY_MIRROR $BASE_PACKAGES"
if [[ -s $out && $(cat "$out.made-from" 2>/dev/null) == "$want" && -z ${REBUILD:-} ]]; then
	log "base: $out (REBUILD=1 to make it again)"
else
	log "base: mmdebstrap $SUITE ($BASE_PACKAGES)"
	# APT::Sandbox::User root: apt's _apt user needs a world-writable
	# /dev/null, which some build hosts (sandboxes) lack.
	# shellcheck disable=SC2016 # $1 is the hook's argument, expanded by mmdebstrap's shell
	mmdebstrap --mode=root --format=tar --variant=minbase --components=main \
		--aptopt='APT::Sandbox::User "root"' \
		--include="$BASE_PACKAGES" \
		--customize-hook='chroot "$1" dpkg-query -W -f="\${Package} \${Version}\n" > "$1/usr/share/doc/frmps-base-packages.txt"' \
		"$SUITE" "$out.tmp" \
		"deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" "deb $SECURITY_MIRROR $SUITE-security main"
	mv "$out.tmp" "$out"
	echo "$want" >"$out.made-from"
fi

got=$(tar -xOf "$out" ./usr/share/doc/frmps-base-packages.txt | sort)
if [[ -n ${RECORD:-} ]]; then
	{
		echo "# Debian $SUITE packages of the frmps image base (deploy/image/rootfs.sh; RECORD=1 rewrites)."
		echo "$got"
	} >"$list"
	log "recorded $(wc -l <<<"$got") packages in $list"
elif ! diff <(grep -v '^#' "$list") <(echo "$got") >"$WORK/packages.diff"; then
	log "the base's packages differ from $list (Debian updated $SUITE):"
	cat "$WORK/packages.diff" >&2
	[[ -z ${STRICT:-} ]] || die "STRICT=1: base differs from the recorded package list (RECORD=1 to accept)"
fi
echo "$out"
