//! A step of single submissions that repeats the last one: its tensors wait on the
//! submitting side and are reduced as one cached group when the step is synchronized.
//!
//! A step here is what [`FusionEngine::synchronize`] ends: the tensors submitted one by
//! one ([`FusionEngine::submit`]) since the last call, when that call waits for exactly
//! their handles. Such a step teaches the engine its names, in the order they came
//! ([`Repeated::learned`]). When the next step submits the same names in the same order,
//! its tensors are held here instead of queued (no channel message, no name allocated or
//! looked up, no board entry; the step reserves its tickets at once, and each handle
//! shares the learned names, which lead to the engine, through a reference that the last
//! step's handles gave back: no atomic operation per handle but its submission's lock),
//! and its `synchronize` hands them to the cached-group step of
//! [`FusionEngine::all_reduce_group`] under the learned names, returning the results as
//! they come when the handles are in submission order: after two such steps (one
//! registering the group's ids, one its negotiation round) the step is an armed
//! reduction, with no round at all.
//!
//! Nothing of the general path's behaviour changes: a submission that departs from the
//! learned order, an external tensor, a timeline, a `synchronize` or [`Handle::wait`] of
//! other handles, or a cycle of the background thread (which runs while nobody waits, so
//! that reductions overlap the computation that submits them) sends the held tensors on
//! to the queue, in their order, and the step continues there; a step that departed
//! teaches its own names, when it ends as a whole.

use super::*;

/// The most tensors a step records: a caller that never synchronizes (it waits for each
/// handle, or drops them) must not grow the record without bound.
const MAX_STEP_TENSORS: usize = 1 << 16;

/// The learned names and where the current step stands.
#[derive(Debug)]
pub(super) struct Repeated {
    /// The names of the last step that taught one, in submission order.
    learned: Option<Arc<Learned>>,
    /// References to `learned` that the handles of a step synchronized whole gave back,
    /// for the next step's handles: an atomic reference count per handle costs as much as
    /// the rest of its submission.
    spare: Vec<Arc<Learned>>,
    /// The engine this belongs to, for the learned names to lead to.
    core: Weak<Core>,
    step: Step,
    /// When the step's first tensor came.
    since: Instant,
    /// The engine's cycle time.
    cycle_time: Duration,
    /// The last step took longer than a cycle time: the next one wakes the background
    /// thread with its first tensor, so that a cycle queues what is held by then and
    /// reductions overlap the rest of the step. A shorter step's `synchronize` comes
    /// before any cycle would: waking the thread for it would only cost a wake-up.
    long: bool,
    /// The tickets the step reserved at its first submission and has not used yet.
    reserved: std::ops::Range<u64>,
}

#[derive(Debug, Default)]
enum Step {
    /// Nothing submitted since the last `synchronize`.
    #[default]
    Fresh,
    /// Submitted through the queue: the names so far, and the first ticket (the tickets
    /// so far are the ones that follow it).
    Recording { names: Vec<Arc<str>>, first: u64 },
    /// Following the learned names: the tensors held here, and the first ticket.
    Following { tensors: Vec<Tensor>, first: u64 },
    /// Neither: this step teaches nothing and holds nothing.
    Off,
}

/// What a `synchronize` does with the step it ends.
pub(super) enum StepEnd {
    /// The step repeated the learned one: reduce these tensors under these names; the
    /// handle of ticket `first + i` gets the result of tensor `i`.
    Repeat {
        names: TensorNames,
        tensors: Vec<Tensor>,
        first: u64,
    },
    /// Wait for the handles the general way, after queueing these held tensors.
    General(Vec<Held>),
}

/// A held tensor on its way to the queue: its name, values and ticket.
pub(super) type Held = (Arc<str>, Tensor, u64);

/// Names a step taught, in submission order, and the engine they belong to. The handles
/// of a step that repeats them each hold these for their name and their engine (a
/// reference from [`Repeated::spare`] where there is one). The engine holds them too until
/// it stops ([`Repeated::forget_learned`]), which ends that cycle of references.
#[derive(Debug)]
pub(super) struct Learned {
    pub(super) names: TensorNames,
    /// `None` only where no engine was running (this module's tests).
    core: Option<Arc<Core>>,
}

impl Learned {
    /// The name of tensor `index`.
    pub(super) fn name(&self, index: usize) -> &str {
        self.names.get(index).unwrap_or("?")
    }

    /// The engine, while there is one.
    pub(super) fn core(&self) -> Option<&Core> {
        self.core.as_deref()
    }
}

impl Repeated {
    pub(super) fn new(cycle_time: Duration, core: Weak<Core>) -> Repeated {
        Repeated {
            learned: None,
            spare: Vec::new(),
            core,
            step: Step::Fresh,
            since: Instant::now(),
            cycle_time,
            long: true,
            reserved: 0..0,
        }
    }

    /// The ticket of the next submission. A step that starts while names are learned
    /// reserves a ticket for each of them at its first submission (one atomic operation
    /// on the board instead of one per tensor) and uses them in order; past them, or
    /// without learned names, each ticket comes from the board.
    pub(super) fn ticket(&mut self, board: &Board) -> u64 {
        if let (Step::Fresh, Some(learned)) = (&self.step, &self.learned) {
            self.reserved = board.tickets(learned.names.len() as u64);
        }
        self.reserved.next().unwrap_or_else(|| board.ticket())
    }

    /// Holds `tensor` when it is the next one of the learned step (and its ticket follows
    /// the step's last); returns the learned names and its place in them for the handle,
    /// and whether to wake the background thread (see [`Repeated::long`]), or the tensor
    /// back.
    pub(super) fn follow(
        &mut self,
        name: &str,
        tensor: Tensor,
        ticket: u64,
    ) -> std::result::Result<(Arc<Learned>, usize, bool), Tensor> {
        let Some(learned) = &self.learned else {
            return Err(tensor);
        };
        let (at, first) = match &self.step {
            Step::Fresh => (0, ticket),
            Step::Following { tensors, first } => (tensors.len(), *first),
            Step::Recording { .. } | Step::Off => return Err(tensor),
        };
        match learned.names.get(at) {
            Some(next) if next == name && first + at as u64 == ticket => {
                let learned = self.spare.pop().unwrap_or_else(|| Arc::clone(learned));
                match &mut self.step {
                    Step::Following { tensors, .. } => tensors.push(tensor),
                    step => {
                        let mut tensors = Vec::with_capacity(learned.names.len());
                        tensors.push(tensor);
                        *step = Step::Following { tensors, first };
                        self.since = Instant::now();
                    }
                }
                Ok((learned, at, at == 0 && self.long))
            }
            _ => Err(tensor),
        }
    }

    /// Keeps a handle's reference to the learned names for the next step's handles, while
    /// they are the names learned (and no more than a step has handles).
    pub(super) fn give_back(&mut self, learned: Arc<Learned>) {
        if let Some(current) = &self.learned {
            if Arc::ptr_eq(current, &learned) && self.spare.len() < current.names.len() {
                self.spare.push(learned);
            }
        }
    }

    /// How many references wait in the spares.
    #[cfg(test)]
    pub(super) fn spares(&self) -> usize {
        self.spare.len()
    }

    /// Notes a submission that goes through the queue (after [`Repeated::release`], so
    /// nothing is held).
    pub(super) fn record(&mut self, name: &Arc<str>, ticket: u64) {
        match &mut self.step {
            Step::Fresh => {
                self.step = Step::Recording {
                    names: vec![Arc::clone(name)],
                    first: ticket,
                };
                self.since = Instant::now();
            }
            Step::Recording { names, first }
                if *first + names.len() as u64 == ticket && names.len() < MAX_STEP_TENSORS =>
            {
                names.push(Arc::clone(name));
            }
            step => *step = Step::Off,
        }
    }

    /// Makes this step teach nothing (after [`Repeated::release`], so nothing is held).
    pub(super) fn forget_step(&mut self) {
        self.step = Step::Off;
    }

    /// The held tensors, in submission order, for the queue; the step goes on through
    /// the queue, recorded from its first tensor, so that a step that departs from the
    /// learned one (a new order from then on) teaches its own names.
    pub(super) fn release(&mut self) -> Vec<Held> {
        match std::mem::replace(&mut self.step, Step::Off) {
            Step::Following { tensors, first } => {
                let held = self.held(tensors, first);
                let names = held.iter().map(|(name, ..)| Arc::clone(name)).collect();
                self.step = Step::Recording { names, first };
                held
            }
            other => {
                self.step = other;
                Vec::new()
            }
        }
    }

    fn held(&self, tensors: Vec<Tensor>, first: u64) -> Vec<Held> {
        let names = self
            .learned
            .as_ref()
            .map_or(&[][..], |l| &l.names.names[..]);
        names
            .iter()
            .zip(tensors)
            .zip(first..)
            .map(|((name, tensor), ticket)| (Arc::clone(name), tensor, ticket))
            .collect()
    }

    /// Drops the learned names (the engine stops): their handles keep what they need.
    pub(super) fn forget_learned(&mut self) {
        // Held tensors take their names from the learned ones: release them first.
        debug_assert!(
            !self.holds(),
            "learned names forgotten while tensors are held"
        );
        self.learned = None;
        self.spare.clear();
    }

    /// True while tensors are held.
    pub(super) fn holds(&self) -> bool {
        matches!(self.step, Step::Following { .. })
    }

    /// Ends the step at a `synchronize` of the handles with these `tickets`: a step that
    /// repeated the learned one whole, with exactly these handles, is reduced as its
    /// group; one that went through the queue with exactly these handles teaches its
    /// names (at least two: a group of one is no group).
    pub(super) fn end_step(&mut self, tickets: &[u64]) -> StepEnd {
        let covers = |first: u64, n: usize| {
            // Tickets are distinct (one per handle), so n of them in a range of n are all.
            tickets.len() == n && tickets.iter().all(|t| t.wrapping_sub(first) < n as u64)
        };
        let step = std::mem::take(&mut self.step);
        self.reserved = 0..0;
        if !matches!(step, Step::Fresh) {
            self.long = self.since.elapsed() > self.cycle_time;
        }
        match step {
            Step::Following { tensors, first } => {
                let learned = self.learned.as_ref().map(|l| &l.names);
                match learned.filter(|names| names.len() == tensors.len()) {
                    Some(names) if covers(first, tensors.len()) => StepEnd::Repeat {
                        names: names.clone(),
                        tensors,
                        first,
                    },
                    _ => StepEnd::General(self.held(tensors, first)),
                }
            }
            Step::Recording { names, first } => {
                if names.len() >= 2 && covers(first, names.len()) {
                    let same = self.learned.as_ref().is_some_and(|l| {
                        l.names.names.len() == names.len()
                            && l.names.names.iter().zip(&names).all(|(a, b)| a == b)
                    });
                    if !same {
                        self.spare.clear();
                        self.learned = Some(Arc::new(Learned {
                            names: TensorNames {
                                names: names.into(),
                            },
                            core: self.core.upgrade(),
                        }));
                    }
                }
                StepEnd::General(Vec::new())
            }
            Step::Fresh | Step::Off => StepEnd::General(Vec::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t() -> Tensor {
        Tensor::from(vec![1.0f32; 2])
    }

    fn learned(rep: &Repeated) -> Option<TensorNames> {
        rep.learned.as_ref().map(|l| l.names.clone())
    }

    /// Records `names` from ticket `first` and ends the step with all their handles.
    fn teach(rep: &mut Repeated, names: &[&str], first: u64) {
        let tickets: Vec<u64> = (first..).take(names.len()).collect();
        for (n, &ticket) in names.iter().zip(&tickets) {
            rep.record(&Arc::from(*n), ticket);
        }
        assert!(matches!(rep.step, Step::Recording { .. }));
        assert!(matches!(rep.end_step(&tickets), StepEnd::General(h) if h.is_empty()));
    }

    #[test]
    fn a_step_synchronized_whole_teaches_its_names_and_the_next_one_follows_them() {
        let mut rep = Repeated::new(Duration::from_secs(30), Weak::new());
        assert!(rep.follow("a", t(), 0).is_err(), "nothing learned yet");
        teach(&mut rep, &["a", "b", "c"], 0);
        let learned = learned(&rep).expect("learned");
        assert_eq!((learned.get(0), learned.len()), (Some("a"), 3));
        // A step shorter than the cycle time wakes nobody.
        let (held, index, wake) = rep.follow("a", t(), 10).expect("follows");
        assert_eq!((held.name(index), wake), ("a", false));
        let (_, index, wake) = rep.follow("b", t(), 11).expect("follows");
        assert_eq!((held.name(index), wake), ("b", false));
        assert!(rep.holds());
        rep.follow("c", t(), 12).expect("follows");
        match rep.end_step(&[12, 10, 11]) {
            StepEnd::Repeat {
                names,
                tensors,
                first,
            } => {
                assert_eq!((tensors.len(), first), (3, 10));
                // The same names, kept as the same group (its ids stay cached).
                assert!(Arc::ptr_eq(&names.names, &learned.names));
            }
            StepEnd::General(_) => panic!("a whole repeated step is one group"),
        }
        assert!(!rep.holds());
        // Taught again by the same names: the group is kept, not made anew.
        teach(&mut rep, &["a", "b", "c"], 20);
        let again = self::learned(&rep).expect("learned");
        assert!(Arc::ptr_eq(&again.names, &learned.names));
    }

    /// A step that starts while names are learned takes one block of consecutive tickets
    /// at its first submission, so that its tickets follow each other however many are
    /// drawn from the board meanwhile (a group's batch, another thread's); past the
    /// block, and once the step ends, tickets come from the board again.
    #[test]
    fn a_step_of_learned_names_reserves_its_tickets_at_its_first_submission() {
        let board = Board::default();
        let mut rep = Repeated::new(Duration::from_secs(30), Weak::new());
        assert_eq!(
            (rep.ticket(&board), rep.ticket(&board)),
            (0, 1),
            "nothing learned"
        );
        teach(&mut rep, &["a", "b", "c"], 0);
        let first = rep.ticket(&board);
        assert_eq!(first, 2);
        rep.follow("a", t(), first).expect("follows");
        assert_eq!(
            board.ticket(),
            5,
            "a batch drawn meanwhile comes after the block"
        );
        let second = rep.ticket(&board);
        rep.follow("b", t(), second).expect("follows");
        let third = rep.ticket(&board);
        rep.follow("c", t(), third).expect("follows");
        assert_eq!((second, third), (3, 4));
        assert_eq!(rep.ticket(&board), 6, "past the block, from the board");
        rep.end_step(&[first, second, third, 6]);
        // A step that departs at once still uses its block first.
        let next = rep.ticket(&board);
        assert_eq!(next, 7);
        assert!(rep.follow("x", t(), next).is_err());
        rep.record(&Arc::from("x"), next);
        assert_eq!(rep.ticket(&board), 8);
        rep.end_step(&[7, 8]);
        assert!(
            rep.reserved.is_empty(),
            "the step's end returns nothing, keeps nothing"
        );
    }

    /// The references a whole step's handles give back serve the next step's handles (no
    /// new reference per handle), as many as the names at most; one to names no longer
    /// learned is not kept, and names learned anew or forgotten drop the spares.
    #[test]
    fn references_given_back_serve_the_next_steps_handles() {
        let mut rep = Repeated::new(Duration::from_secs(30), Weak::new());
        teach(&mut rep, &["a", "b"], 0);
        let follow =
            |rep: &mut Repeated, n: &str, k: u64| rep.follow(n, t(), k).expect("follows").0;
        let a = follow(&mut rep, "a", 2);
        let b = follow(&mut rep, "b", 3);
        assert_eq!(Arc::strong_count(&a), 3, "the engine's and two new ones");
        assert!(matches!(rep.end_step(&[2, 3]), StepEnd::Repeat { .. }));
        let extra = Arc::clone(&a);
        for l in [a, b, extra] {
            rep.give_back(l);
        }
        assert_eq!(rep.spare.len(), 2, "no more than a step has handles");
        let a = follow(&mut rep, "a", 4);
        let b = follow(&mut rep, "b", 5);
        assert!(rep.spare.is_empty(), "both taken from the spares");
        assert_eq!(Arc::strong_count(&a), 3, "and none made");
        assert!(matches!(rep.end_step(&[4, 5]), StepEnd::Repeat { .. }));
        rep.give_back(a);
        // New names: the spares of the old ones go, and the old ones are not taken back.
        teach(&mut rep, &["x", "y"], 6);
        assert!(rep.spare.is_empty());
        rep.give_back(Arc::clone(&b));
        assert!(rep.spare.is_empty(), "not the names learned");
        assert_eq!(Arc::strong_count(&b), 1, "nothing else holds the old names");
        let x = follow(&mut rep, "x", 8);
        follow(&mut rep, "y", 9);
        assert!(matches!(rep.end_step(&[8, 9]), StepEnd::Repeat { .. }));
        rep.give_back(Arc::clone(&x));
        rep.forget_learned();
        assert_eq!(
            Arc::strong_count(&x),
            1,
            "forgetting the names drops the spares"
        );
    }

    #[test]
    fn a_departure_or_a_partial_synchronize_hands_the_held_tensors_back_in_order() {
        let mut rep = Repeated::new(Duration::from_secs(30), Weak::new());
        teach(&mut rep, &["a", "b", "c"], 0);
        rep.follow("a", t(), 5).expect("follows");
        rep.follow("b", t(), 6).expect("follows");
        // Another name, a skipped ticket: not held.
        assert!(rep.follow("x", t(), 7).is_err());
        assert!(rep.follow("c", t(), 8).is_err());
        let held = rep.release();
        let got: Vec<(&str, u64)> = held.iter().map(|(n, _, k)| (&**n, *k)).collect();
        assert_eq!(got, [("a", 5), ("b", 6)]);
        assert!(!rep.holds() && rep.release().is_empty());
        // The step goes on through the queue, recorded from its start: whole, it
        // teaches its own names.
        rep.record(&Arc::from("x"), 7);
        assert!(
            rep.follow("c", t(), 8).is_err(),
            "the step holds nothing more"
        );
        assert!(matches!(rep.end_step(&[7, 5, 6]), StepEnd::General(h) if h.is_empty()));
        let learned = learned(&rep).expect("learned");
        let names: Vec<&str> = (0..learned.len()).filter_map(|i| learned.get(i)).collect();
        assert_eq!(names, ["a", "b", "x"]);

        // Whole, but synchronized with fewer handles (or others): back, in order.
        for tickets in [&[10u64, 11][..], &[10, 11, 99][..]] {
            for (n, k) in ["a", "b", "x"].into_iter().zip(10u64..) {
                rep.follow(n, t(), k).expect("follows");
            }
            match rep.end_step(tickets) {
                StepEnd::General(held) => {
                    let ks: Vec<u64> = held.iter().map(|h| h.2).collect();
                    assert_eq!(ks, [10, 11, 12]);
                }
                StepEnd::Repeat { .. } => panic!("not the step's handles"),
            }
        }
    }

    #[test]
    fn only_a_whole_contiguous_step_of_two_or_more_teaches() {
        let mut rep = Repeated::new(Duration::from_secs(30), Weak::new());
        teach(&mut rep, &["solo"], 0);
        assert!(rep.learned.is_none(), "a group of one is no group");
        // A gap in the tickets (another submission came between).
        rep.record(&Arc::from("a"), 0);
        rep.record(&Arc::from("b"), 2);
        rep.end_step(&[0, 2]);
        assert!(rep.learned.is_none());
        // Synchronized in part.
        rep.record(&Arc::from("a"), 3);
        rep.record(&Arc::from("b"), 4);
        rep.end_step(&[3]);
        assert!(rep.learned.is_none());
        // A step with the caller's memory in it.
        rep.record(&Arc::from("a"), 5);
        rep.forget_step();
        rep.record(&Arc::from("b"), 6);
        rep.end_step(&[5, 6]);
        assert!(rep.learned.is_none());
        // Too many to record.
        for k in 0..=MAX_STEP_TENSORS as u64 {
            rep.record(&Arc::from("n"), 10 + k);
        }
        assert!(matches!(rep.step, Step::Off));
    }

    #[test]
    fn a_step_longer_than_the_cycle_time_wakes_the_background_thread_in_the_next() {
        let mut rep = Repeated::new(Duration::from_millis(1), Weak::new());
        rep.record(&Arc::from("a"), 0);
        rep.record(&Arc::from("b"), 1);
        std::thread::sleep(Duration::from_millis(5));
        rep.end_step(&[0, 1]);
        assert!(rep.follow("a", t(), 2).expect("follows").2);
        assert!(!rep.follow("b", t(), 3).expect("follows").2);
        // This one ends at once: the next step wakes nobody.
        assert!(matches!(rep.end_step(&[2, 3]), StepEnd::Repeat { .. }));
        assert!(!rep.follow("a", t(), 4).expect("follows").2);
    }
}
