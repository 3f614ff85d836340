//! Tensor ids to MLX arrays, or to the failure that poisoned them.

pub use crate::failure::Failure;
use crate::mlx::Array;
use crate::protocol::Id;
use std::collections::HashMap;
use std::rc::Rc;

enum Slot {
    Ready(Array),
    Poisoned(Rc<Failure>),
}

#[derive(Default)]
pub struct Registry {
    slots: HashMap<Id, Slot>,
}

impl Registry {
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn contains(&self, id: Id) -> bool {
        self.slots.contains_key(&id)
    }

    /// The array behind `id`, or the failure to pass on (an unknown id is a
    /// failure of `op`, the op that asked for it).
    pub fn get(&self, id: Id, op: &str) -> Result<&Array, Rc<Failure>> {
        match self.slots.get(&id) {
            Some(Slot::Ready(a)) => Ok(a),
            Some(Slot::Poisoned(f)) => Err(f.clone()),
            None => Err(Failure::new(
                op,
                format!("unknown tensor id {id} (never defined, or released)"),
            )),
        }
    }

    /// All inputs, or the first failure among them.
    pub fn inputs(&self, ids: &[Id], op: &str) -> Result<Vec<&Array>, Rc<Failure>> {
        ids.iter().map(|id| self.get(*id, op)).collect()
    }

    pub fn insert(&mut self, id: Id, array: Array) {
        self.slots.insert(id, Slot::Ready(array));
    }

    pub fn poison(&mut self, id: Id, failure: Rc<Failure>) {
        self.slots.insert(id, Slot::Poisoned(failure));
    }

    pub fn release(&mut self, id: Id) -> bool {
        self.slots.remove(&id).is_some()
    }
}
