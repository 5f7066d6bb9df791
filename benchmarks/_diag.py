import jax, jax.numpy as jnp
from lineattn.ops.pallas import chunk_fwd
print("PASS_IMPL", chunk_fwd.PASS_IMPL, "hopper", chunk_fwd.hopper(), chunk_fwd.__file__)
orig = chunk_fwd.mosaic_pass
def spy(*a):
    r = orig(*a); print("mosaic_pass", a, "->", r); return r
chunk_fwd.mosaic_pass = spy
from lineattn import ops
B,T,H,K,V=2,2045,32,128,128
q=jnp.zeros((B,T,H,K),jnp.bfloat16); g=jnp.zeros((B,T,H,K)); beta=jnp.zeros((B,T,H),jnp.bfloat16)
loss = lambda q: jnp.sum(ops.linear_attention("kda", q,q,q,g,beta,backend="pallas")[0].astype(jnp.float32))
j = str(jax.make_jaxpr(jax.grad(loss))(q))
print("in jaxpr:", "lineattn_state_pass_mosaic" in j, "lineattn_solve_mosaic" in j, "lineattn_chunk_state_pass" in j)
