# Issue 24: deliveries per hubcast CPU-second, on ÷ off per round, from recovery-core-log.sh outputs (the quiet rerun of 2026-11-28-recovery-core-log.md).
import sys,re,statistics as st
rows={}
for f in sys.argv[1:]:
  lab=None;hdr=None;run=0
  for line in open(f):
    if line.startswith('=== 2. CPU time'): run+=1
    m=re.match(r'=== round (\d+) (\S+)',line)
    if m: lab=((f,run),int(m.group(1)),m.group(2)); continue
    if line.startswith('rate'): hdr=line.split(); continue
    if line.strip().startswith('max') and lab:
      v=dict(zip(hdr,line.split())); 
      d=float(v['delivered_msg_s'].replace(',',''))/float(v['hubcast_cpu'])
      rows[lab]=(d,float(v['hubcast_rss_mb']),float(v['user_us_per_msg']))
keys=sorted({(k[0],k[1]) for k in rows})
r={'base':[], 'new':[]}; nb=[]
for k in keys:
  try:
    for b in ('base','new'):
      r[b].append(rows[k+(b+'-on',)][0]/rows[k+(b+'-off',)][0])
    nb.append(rows[k+('new-on',)][0]/rows[k+('base-on',)][0])
  except KeyError: pass
for b in r: print(b,'on/off per round',' '.join('%.2f'%x for x in r[b]),'median %.3f'%st.median(r[b]))
print('new/base on per round',' '.join('%.2f'%x for x in nb),'median %.3f'%st.median(nb))
for lab in ('base-on','base-off','new-on','new-off'):
  v=[rows[k+(lab,)][0] for k in keys if k+(lab,) in rows]; rs=[rows[k+(lab,)][1] for k in keys if k+(lab,) in rows]
  print(lab,'k deliveries/CPU-s median %.0f'%(st.median(v)/1000),'[%.0f-%.0f]'%(min(v)/1000,max(v)/1000),'RSS median %.1f MB'%st.median(rs))
