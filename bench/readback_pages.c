/* The kernel's share of a 64 MiB sealed readback (docs/latency.md, "Large
 * readbacks on a quiet machine"): the worker's side (writing a new memory
 * file, one with its pages allocated already, or one mapped) and the VM's
 * (reading a fresh mapping, populated or not). Medians of 9.
 *
 *   cc -O2 -mavx2 bench/readback_pages.c -o /tmp/readback_pages && /tmp/readback_pages
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <fcntl.h>
#include <unistd.h>
#include <time.h>
#include <immintrin.h>
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#define N (64UL<<20)
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static char *src,*dst;
static void ntcopy(char*d,const char*s,size_t n){for(size_t i=0;i<n;i+=64){__m256i a=_mm256_loadu_si256((void*)(s+i)),b=_mm256_loadu_si256((void*)(s+i+32));_mm256_stream_si256((void*)(d+i),a);_mm256_stream_si256((void*)(d+i+32),b);}_mm_sfence();}
static int seal(int fd){return fcntl(fd,F_ADD_SEALS,F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_WRITE|F_SEAL_SEAL);}
static int mk(){return memfd_create("x",MFD_CLOEXEC|MFD_ALLOW_SEALING);}
#define GB(t) (N/(t)/1e9)
static double w_write(){double t=now();int fd=mk();size_t o=0;while(o<N){ssize_t r=pwrite(fd,src+o,N-o,o);o+=r;}seal(fd);t=now()-t;close(fd);return t;}
static double w_falloc_write(){double t=now();int fd=mk();fallocate(fd,0,0,N);size_t o=0;while(o<N){ssize_t r=pwrite(fd,src+o,N-o,o);o+=r;}seal(fd);t=now()-t;close(fd);return t;}
static double w_mmap(int flags,int nt,int fa){double t=now();int fd=mk();if(fa)fallocate(fd,0,0,N);else ftruncate(fd,N);char*p=mmap(0,N,PROT_READ|PROT_WRITE,MAP_SHARED|flags,fd,0);if(nt)ntcopy(p,src,N);else memcpy(p,src,N);munmap(p,N);seal(fd);t=now()-t;close(fd);return t;}
static int reusefd=-1;
static double w_reuse(){ if(reusefd<0){reusefd=mk();pwrite(reusefd,src,N,0);} double t=now();size_t o=0;while(o<N){ssize_t r=pwrite(reusefd,src+o,N-o,o);o+=r;}t=now()-t;return t;}
static double falloc_only(){double t=now();int fd=mk();fallocate(fd,0,0,N);t=now()-t;close(fd);return t;}
static double s_pwrite(){int fd=mk();fallocate(fd,0,0,N);double t=now();size_t o=0;while(o<N){ssize_t r=pwrite(fd,src+o,N-o,o);o+=r;}seal(fd);t=now()-t;close(fd);return t;}
static double s_map(int nt,int unmap_after){int fd=mk();fallocate(fd,0,0,N);char*p=mmap(0,N,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_POPULATE,fd,0);double t=now();if(nt)ntcopy(p,src,N);else memcpy(p,src,N);double u=now();munmap(p,N);double u2=now();int r=seal(fd);t=now()-t;if(r)perror("seal");if(unmap_after)printf("   munmap %.2f ms\n",(u2-u)*1e3);close(fd);return t;}
static double s_cleanup(){int fd=mk();fallocate(fd,0,0,N);double t=now();close(fd);return now()-t;}
/* VM side */
static int sealedfd=-1;
static double r_map(int flags,int madv,int nt){double t=now();char*p=mmap(0,N,PROT_READ,MAP_SHARED|flags,sealedfd,0);if(madv)madvise(p,N,MADV_POPULATE_READ);if(nt==2){volatile long s=0;for(size_t i=0;i<N;i+=4096)s+=p[i];} else memcpy(dst,p,N);t=now()-t;munmap(p,N);return t;}
static double r_plain(){double t=now();memcpy(dst,src,N);t=now()-t;return t;}
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
#define RUN(name,expr) {double v[9];for(int i=0;i<9;i++)v[i]=expr;qsort(v,9,8,cmp);printf("%-40s %7.2f GB/s  %7.2f ms\n",name,GB(v[4]),v[4]*1e3);}
int main(){src=malloc(N);dst=malloc(N);memset(src,1,N);memset(dst,2,N);
 RUN("worker: pwrite fresh memfd",w_write());
 RUN("worker: fallocate+pwrite",w_falloc_write());
 RUN("worker: fallocate alone",falloc_only());
 RUN("worker: ftruncate+mmap+memcpy",w_mmap(0,0,0));
 RUN("worker: ftruncate+mmap POPULATE+memcpy",w_mmap(MAP_POPULATE,0,0));
 RUN("worker: ftruncate+mmap+ntcopy",w_mmap(0,1,0));
 RUN("worker: fallocate+mmap+ntcopy",w_mmap(0,1,1));
 RUN("worker: ftruncate+mmap POPULATE+ntcopy",w_mmap(MAP_POPULATE,1,0));
 RUN("worker: pwrite into reused (upper bound)",w_reuse());
 RUN("spare: fallocated, pwrite+seal",s_pwrite());
 RUN("spare: premapped, memcpy+munmap+seal",s_map(0,0));
 RUN("spare: premapped, ntcopy+munmap+seal",s_map(1,0));
 s_map(0,1);
 RUN("close of a 64MiB memfd (free)",s_cleanup());
 sealedfd=mk();pwrite(sealedfd,src,N,0);seal(sealedfd);
 RUN("vm: plain memcpy prefaulted",r_plain());
 RUN("vm: mmap + memcpy",r_map(0,0,0));
 RUN("vm: mmap POPULATE + memcpy",r_map(MAP_POPULATE,0,0));
 RUN("vm: mmap + MADV_POPULATE_READ + memcpy",r_map(0,1,0));
{char*p=mmap(0,N,PROT_READ,MAP_SHARED|MAP_POPULATE,sealedfd,0);RUN("vm: reused mapping memcpy",(({double t=now();memcpy(dst,p,N);now()-t;})));munmap(p,N);}
 RUN("vm: mmap + touch pages only",r_map(0,0,2));
 RUN("vm: mmap POPULATE only(+touch)",r_map(MAP_POPULATE,0,2));
 RUN("vm: mmap MADV_POPULATE_READ only(+touch)",r_map(0,1,2));
}
