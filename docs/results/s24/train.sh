# Both runs side by side, from random towers (a second call resumes an unfinished one); $1: minutes this call may train.
MIX="scene=0.4,text=0.15,document=0.3,chart=0.15"
R=$OUT/res; mkdir -p $R
for L in 4 6; do
  python3 -m eval.train.towers --model demo-internvl --pack --mix $MIX --batch 48 --workers 7 --save-every 100 \
    --lr 1e-3 --warmup 200 --minutes 6 --layers $L --stop-after ${1:-8} --export --out /root/runs/iv$L \
    >> $R/train_$L.log 2>&1 &
done
wait
for L in 4 6; do echo "== $L layers"; grep -v "^Loading\|Warn" $R/train_$L.log | head -3; grep "^step" $R/train_$L.log | tail -2
  grep "done\|unfinished\|Error\|error" $R/train_$L.log | tail -3; done
for L in 4 6; do cp /root/runs/iv$L/log.json $R/log_$L.json 2>/dev/null || true; done
tar -czf $OUT/train.tar.gz -C $OUT res
