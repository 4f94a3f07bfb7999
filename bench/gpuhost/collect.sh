# On the device: what is done so far into $OUT (run at the end of every call: a machine given
# back loses everything not brought back).
cp /tmp/res/*.json /tmp/res/*.log "$OUT"/ 2>/dev/null
for k in /tmp/keep_*; do [ -d "$k" ] && tar -cJf "$OUT/$(basename "$k").tar.xz" -C /tmp "$(basename "$k")"; done
(lscpu; nproc; uptime) > "$OUT/machine.txt"
ls -la "$OUT"
